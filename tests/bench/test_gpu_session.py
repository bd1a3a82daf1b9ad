"""bench/gpu/: the scripted GPU session. Its commands must run first time on the GPU machine, so every benchmark it
names exists and takes the flags it is given, the shell script parses, and collect.py reports failures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "bench" / "gpu" / "session.sh"


def test_session_script_parses():
    subprocess.run(["bash", "-n", str(SESSION)], check=True)


@pytest.mark.parametrize("script", sorted(set(re.findall(r"bench/(\w+)\.py", SESSION.read_text()))))
def test_every_benchmark_the_session_runs_takes_its_flags(script):
    text = SESSION.read_text()
    flags = set()
    for line in text.splitlines():
        if f"bench/{script}.py" in line:
            flags |= set(re.findall(r"(--[a-z][a-z0-9-]*)", line.split(f"bench/{script}.py", 1)[1]))
    path = ROOT / "bench" / f"{script}.py"
    assert path.exists(), f"session.sh runs bench/{script}.py, which does not exist"
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [f for f in sorted(flags) if f not in out.stdout]
    assert not missing, f"bench/{script}.py --help does not offer {missing}"


def test_collect_copies_results_and_names_failures(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("collect", ROOT / "bench" / "gpu" / "collect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "dest")
    (tmp_path / "dest").mkdir()
    src = tmp_path / "at"
    (src / "results").mkdir(parents=True)
    (src / "results" / "attention-x-2026.json").write_text("{}")
    (src / "results" / "gpu-tests-x-2026.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0"/></testsuites>')
    (src / "status.txt").write_text("pytest-gpu rc=0 420s-limit took=30s\nquant rc=1 150s-limit took=9s\n")
    assert mod.main([str(src)]) == 1
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["attention-x-2026.json", "gpu-tests-x-2026.xml"]
    (src / "status.txt").write_text("pytest-gpu rc=0 420s-limit took=30s\n")
    assert mod.main([str(src)]) == 0
