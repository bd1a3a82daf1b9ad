"""Every committed figure the docs and code cite must exist: a renamed or re-measured result file leaves no dangling
reference (the README's performance table is written from these files only)."""

import re
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
