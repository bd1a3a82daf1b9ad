"""Copy what a GPU session brought back into bench/results/, and say what came and what failed.

    python bench/gpu/collect.py FILES_AT      # the device tool's files_at folder (it holds results/ and logs/)

Result files (JSON, the cProfile summary, the pytest junit XML) are copied as they are: the scripts named them by
benchmark, device and day. Nothing is merged or rewritten; the README's performance table is then updated by hand
from these files. Exit 1 if a command of the session failed (see status.txt and logs/ there).
"""

from __future__ import annotations

import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = Path(argv[0])
    src = root / "results"
    if not src.is_dir():
        print(f"{src} does not exist: was the session's $OUT the device tool's $OUT?", file=sys.stderr)
        return 2
    for f in sorted(src.iterdir()):
        if f.suffix in (".json", ".txt", ".xml") and f.stat().st_size:
            shutil.copy2(f, RESULTS / f.name)
            print(f"copied {f.name}")
    for junit in sorted(src.glob("gpu-tests-*.xml")):
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = ", ".join(f"{k} {suite.get(k)}" for k in ("tests", "failures", "errors", "skipped"))
        print(f"pytest -m gpu ({junit.name}): {counts}")
    status = root / "status.txt"
    lines = status.read_text().splitlines() if status.exists() else []
    failed = [line for line in lines if " rc=" in line and " rc=0 " not in line]
    for line in failed:
        print(f"FAILED: {line} (log: {root / 'logs'})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
