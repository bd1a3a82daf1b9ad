"""The scripts under bench/ (a folder of scripts, not a package) loaded as modules for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/<path> (e.g. "decode.py", "gpu/collect.py") as a module named <stem>_bench: bench/ first on sys.path,
    as when it runs as a script (for bench_meta and its other siblings), and the module in sys.modules while the test
    runs (dataclasses look their module up there)."""
    file = ROOT / "bench" / path
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"{file.stem}_bench", file)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod
