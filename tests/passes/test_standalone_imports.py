"""Every pass module imports on its own, in a fresh interpreter: a pass that names a kiln op must import the module
that registers it, not rely on another module having been imported first (the suite's order hides this)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PASSES = Path(__file__).resolve().parents[2] / "passes"


def test_every_pass_module_imports_alone():
    names = sorted(p.stem for p in PASSES.glob("*.py") if p.stem != "__init__")
    assert "kv_cache" in names and "gqa_fusion" in names
    procs = {n: subprocess.Popen([sys.executable, "-c", f"import kiln.passes.{n}"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for n in names}
    failed = {n: p.communicate(timeout=300)[0].strip().splitlines()[-1:] for n, p in procs.items()}
    assert not {n: out for n, out in failed.items() if procs[n].returncode != 0}
