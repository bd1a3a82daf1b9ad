"""Every committed figure the docs and code cite must exist: a renamed or re-measured result file leaves no dangling
reference. The README's performance tables are written from these files only, so every figure in them must be
a value of the file its row cites (its `file` column, or the result file the text just before the table cites), at
the precision shown: a re-measured file or an edited figure that no longer agrees fails here."""

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"bench/results/[A-Za-z0-9_.+/-]+\.(?:json|txt|svg|md)")
SOURCES = ["README.md", "bench/README.md", "docs", "runtime", "compiler", "passes", "codegen", "bench"]


def _cited() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in SOURCES:
        base = ROOT / name
        files = [base] if base.is_file() else [*base.rglob("*.md"), *base.rglob("*.py")]
        for path in files:
            if "results" in path.relative_to(ROOT).parts[:2]:
                continue  # the result files' own READMEs describe their folder
            for ref in CITED.findall(path.read_text()):
                found.setdefault(ref, []).append(str(path.relative_to(ROOT)))
    return found


def test_docs_cite_result_files() -> None:
    assert len(_cited()) >= 5  # the README's performance table alone cites more


def test_every_cited_result_file_exists() -> None:
    missing = {ref: where for ref, where in _cited().items() if not (ROOT / ref).exists()}
    assert not missing, f"cited but not committed under bench/results/: {missing}"


# The figures of the README's performance tables against their files.

# A figure as written: a number (thousands with commas), or numbers joined by " / " or "-" (p50 / p99, a range),
# with the unit after the last one, which they all share.
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
_FIGURE = re.compile(rf"(?<![\w.+-])([+-]?{_NUMBER}(?:\s*[/-]\s*{_NUMBER})*)(?:\s*(ms|us|µs|s|%|x)(?!\w))?")
# What a file's value may be multiplied by to be shown in a unit (a file may hold seconds, ms or us; a fraction or a
# percentage).
_SCALES = {None: (1.0,), "x": (1.0,), "%": (100.0, 1.0), "ms": (1e3, 1.0, 1e-3), "us": (1e6, 1e3, 1.0),
           "µs": (1e6, 1e3, 1.0), "s": (1.0, 1e-3, 1e-6)}
# Columns that only name what was run (the figures are in the others).
_LABEL_COLUMNS = {"benchmark", "device", "file"}


def _per_policy_ms_per_token(data: dict, path: Path) -> Iterator[float]:
    """`kiln bench throughput`: the time per scheduled token (prefill and decode rows) of each policy, in ms."""
    for policy in ("continuous", "static"):
        yield 1e3 * data[policy]["elapsed_s"] / data[policy]["batched_tokens"]


def _vs_fp32_percent(data: dict, path: Path) -> Iterator[float]:
    """`kiln bench perplexity`, one file per variant: its perplexity against the fp32 file's beside it, in %."""
    fp32 = json.loads((path.parent / "fp32.json").read_text())["variants"]["fp32"]["perplexity"]
    for v in data["variants"].values():
        yield 100 * (v["perplexity"] / fp32 - 1)


def _mod_rows(data: dict, path: Path) -> Iterator[float]:
    """bench/mod_routers.py: each row's FLOPs per token over the dense row's, and its mean routed fraction."""
    dense = next(r for r in data["rows"] if r["capacity"] is None)
    for r in data["rows"]:
        yield r["flops_per_token"] / dense["flops_per_token"]
        if r["routed_fraction"]:
            yield sum(r["routed_fraction"].values()) / len(r["routed_fraction"])


# Figures computed from a file's values, by the file's name.
DERIVED: dict[str, Callable[[dict, Path], Iterator[float]]] = {
    r"bench/results/throughput-": _per_policy_ms_per_token,
    r"bench/results/perplexity-[^/]+/": _vs_fp32_percent,
    r"bench/results/mod-": _mod_rows,
}

# Figures a row shows that its file does not hold, each with why; an entry whose figure has left its row fails.
NOT_IN_FILE = {
    "bench/results/throughput-tiny-llama-cpu-2026-11-24.json": {
        "0.78": "the range of three earlier runs, whose files were not kept", "0.95": "the same range"},
    "bench/results/speculative-smollm2-135m-cpu--x86-64--2-threads-2026-11-24.json": {
        "30": "SmolLM2-135M's layer count, a fact of the model"},
}
# Columns whose figures no file holds, with why.
NOT_IN_FILE_COLUMNS = {
    "before": "the previous MoD recipe's perplexities, measured earlier the same day (the README says so); their file "
              "was not kept",
}


def _performance(readme: str) -> list[str]:
    lines = readme.splitlines()
    start = lines.index("## Performance")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _tables(lines: list[str]) -> Iterator[tuple[list[str], list[list[str]], str | None]]:
    """Each table: its header, its rows, and the last result JSON the text before it (since the last table) cites."""
    cur: list[list[str]] = []
    text: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            cur.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if cur:
            before = [ref for ref in CITED.findall("\n".join(text)) if ref.endswith(".json")]
            yield [h.lower() for h in cur[0]], cur[2:], before[-1] if before else None
            cur, text = [], []
        text.append(line)


def _figures(cell: str) -> Iterator[tuple[str, str | None]]:
    """Each number of a cell as written (sign included), with its unit."""
    for m in _FIGURE.finditer(cell):
        group, unit = m.group(1), m.group(2)
        numbers = re.findall(_NUMBER, group)
        if group[0] in "+-":
            numbers[0] = group[0] + numbers[0]
        for n in numbers:
            yield n, unit


def _values(x: object) -> Iterator[float]:
    """A file's numbers; a long list of plain numbers (token ids) is data, not a figure."""
    if isinstance(x, bool) or x is None:
        return
    if isinstance(x, int | float):
        yield float(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _values(v)
    elif isinstance(x, list) and not (len(x) > 8 and all(isinstance(v, int | float) for v in x)):
        for v in x:
            yield from _values(v)


def _candidates(ref: str) -> list[float]:
    path = ROOT / ref
    data = json.loads(path.read_text())
    found = list(_values(data))
    for pattern, derive in DERIVED.items():
        if re.match(pattern, ref):
            found += derive(data, path)
    return found


def _shows(written: str, unit: str | None, candidates: list[float]) -> bool:
    """Whether some value, in the unit, rounds to the figure as written (to its last digit)."""
    shown = float(written.replace(",", ""))
    decimals = len(written.split(".")[1]) if "." in written else 0
    tol = 0.5 * 10**-decimals * (1 + 1e-9)
    return any(abs(v * s - shown) <= tol for v in candidates for s in _SCALES[unit])


def figure_problems(readme: str) -> list[str]:
    """What in the README's performance tables no cited file backs: rows that name no result JSON, figures that no
    value of the row's file gives, exceptions that are no longer in their row."""
    problems: list[str] = []
    unused = {(ref, n) for ref, ns in NOT_IN_FILE.items() for n in ns}
    for head, rows, before in _tables(_performance(readme)):
        for row in rows:
            cells = dict(zip(head, row, strict=True))
            refs = CITED.findall(cells["file"]) if "file" in cells else [before] if before else []
            if len(refs) != 1 or not refs[0].endswith(".json"):
                problems.append(f"{row[0]!r}: a figure row names one result JSON (its file column, or the text "
                                f"before its table), not {refs}")
                continue
            ref = refs[0]
            candidates = _candidates(ref)
            for col, cell in list(cells.items())[1:]:
                if col in _LABEL_COLUMNS or col in NOT_IN_FILE_COLUMNS:
                    continue
                for written, unit in _figures(cell):
                    if written in NOT_IN_FILE.get(ref, {}):
                        unused.discard((ref, written))
                    elif not _shows(written, unit, candidates):
                        problems.append(f"{row[0]!r}, {col}: {written}{unit or ''} is no value of {ref}")
    problems += [f"NOT_IN_FILE[{ref!r}][{n!r}] is in no row of that file: remove it" for ref, n in sorted(unused)]
    return problems


def test_performance_figures_are_values_of_the_files_they_cite() -> None:
    readme = (ROOT / "README.md").read_text()
    tables = list(_tables(_performance(readme)))
    assert sum(len(rows) for _, rows, _ in tables) >= 20  # the tables are found (7 + 10 + 4 + 5 rows today)
    assert not figure_problems(readme)


def test_a_stale_figure_is_caught() -> None:
    """The check can fail: each figure of 3 or more significant digits, changed in its last digit, is reported."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    start = lines.index("## Performance")
    section = "\n".join(_performance(readme))
    values = [v for ref in set(CITED.findall(section)) if ref.endswith(".json") for v in _candidates(ref)]
    head: list[str] = []
    changed, unchecked = 0, []
    for at in range(start, start + len(_performance(readme))):
        if not lines[at].startswith("|"):
            head = []
            continue
        pieces = lines[at].split("|")  # "", then the cells, then ""
        if not head:
            head = [p.strip().lower() for p in pieces[1:-1]]
        for col, cell in list(zip(head, pieces[1:-1], strict=True))[1:]:
            if col in _LABEL_COLUMNS or col in NOT_IN_FILE_COLUMNS or set(cell.strip()) <= set("-: "):
                continue
            for m in re.finditer(rf"(?<![\w.]){_NUMBER}", cell):
                written = m.group(0)
                if len(written.replace(",", "").replace(".", "").lstrip("0")) < 3:
                    continue
                bumped = written[:-1] + str((int(written[-1]) + 5) % 10)
                stale_cell = cell[: m.start()] + bumped + cell[m.end() :]
                stale = lines[:at] + ["|".join([*pieces[: 1 + head.index(col)], stale_cell,
                                                *pieces[2 + head.index(col) :]])] + lines[at + 1 :]
                if figure_problems("\n".join(stale)):
                    changed += 1
                else:  # the check knows only that the number is in the file: the change made it another value
                    assert any(_shows(bumped, unit, values) for unit in _SCALES), f"{written} -> {bumped} passed"
                    unchecked.append(f"{written} -> {bumped}")
    assert changed >= 40 and len(unchecked) <= changed // 10, unchecked
