"""Copy what a GPU session brought back into bench/results/, and say what came and what failed.

    python bench/gpu/collect.py FILES_AT      # the device tool's files_at folder (it holds results/ and logs/)

Result files (JSON, the cProfile summary, the pytest junit XML) are copied as they are: the scripts named them by
benchmark, device and day. Nothing is merged or rewritten; the README's performance table is then updated by hand
from these files. Errors a script recorded in its JSON and went on past (a row's "error", a variant's "*_error",
"errors", "mismatches", a "status" short of "complete") are printed too. Exit 1 if a command of the session failed
(see status.txt and logs/ there) or a result file records an error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def recorded_errors(node: object, path: str = "") -> Iterator[str]:
    """'where: what' for each error a result file records (the benchmarks record a failing row or variant, and go
    on, rather than lose the rest)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from recorded_errors(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}.{key}" if path else key
        if key == "errors":  # a list repeats the rows' own "error" (found there); a dict names what failed
            if isinstance(value, dict):
                yield from (f"{where}.{name}: {msg}" for name, msg in value.items())
        elif (key == "error" or key.endswith("_error")) and isinstance(value, str) and value:
            yield f"{where}: {value}"
        elif key == "mismatches" and isinstance(value, list):
            yield from (f"{where}: {msg}" for msg in value)
        elif key == "status" and isinstance(value, str) and value != "complete":
            yield f"{where}: {value}"
        else:
            yield from recorded_errors(value, where)


def log_tail(root: Path, name: str, lines: int = 15) -> list[str]:
    """The last lines of a command's log: session.sh packs logs/ into logs.tar.gz (the device tool brings back at
    most 8 files), a run stopped before that leaves logs/ as it is."""
    path = root / "logs" / f"{name}.log"
    if path.exists():
        return path.read_text(errors="replace").splitlines()[-lines:]
    try:
        with tarfile.open(root / "logs.tar.gz") as tar:
            member = tar.extractfile(f"logs/{name}.log")
            text = member.read().decode(errors="replace") if member is not None else ""
    except (OSError, KeyError, tarfile.TarError):
        return [f"(no log of {name} in {root})"]
    return text.splitlines()[-lines:] + [f"(whole log: tar -xzf {root / 'logs.tar.gz'} logs/{name}.log)"]


def local_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = Path(argv[0])
    src = root / "results"
    if not src.is_dir():
        print(f"{src} does not exist: was the session's $OUT the device tool's $OUT?", file=sys.stderr)
        return 2
    errors = 0
    head = local_head()
    for f in sorted(src.iterdir()):
        if f.suffix in (".json", ".txt", ".xml") and f.stat().st_size:
            shutil.copy2(f, RESULTS / f.name)
            print(f"copied {f.name}")
        if f.suffix == ".json" and f.stat().st_size:
            try:
                data = json.loads(f.read_text())
                found = list(recorded_errors(data))
            except json.JSONDecodeError as e:  # a run killed while writing (the scripts write whole files)
                data, found = None, [f"not valid JSON: {e}"]
            commit = data.get("commit") if isinstance(data, dict) else None
            if head and commit and commit.removesuffix("-dirty") != head:
                # .gpu/deps/COMMIT is written by wheels.sh: a commit since then stamps results with the old one
                print(f"WARNING {f.name}: measured at commit {commit}, but HEAD here is {head}; if the tree changed "
                      "since `bash bench/gpu/wheels.sh`, run `bash bench/gpu/wheels.sh --commit` before the next call")
            errors += len(found)
            for line in found[:5]:
                print(f"ERROR in {f.name}: {line[:300]}")
            if len(found) > 5:
                print(f"ERROR in {f.name}: ... and {len(found) - 5} more")
    for junit in sorted(src.glob("gpu-tests-*.xml")):
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = ", ".join(f"{k} {suite.get(k)}" for k in ("tests", "failures", "errors", "skipped"))
        print(f"pytest -m gpu ({junit.name}): {counts}")
    status = root / "status.txt"
    lines = status.read_text().splitlines() if status.exists() else []
    failed = [line for line in lines if " rc=" in line and " rc=0 " not in line]
    for line in failed:
        name = line.split(" rc=")[0]
        print(f"FAILED: {line}")
        for text in log_tail(root, name):
            print(f"    {text}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
