"""bench/attention.py and bench/decode_attention.py in --smoke mode (Triton's interpreter, tiny shapes): every
code path of the GPU runs except CUDA timing, so the GPU session does not discover a typo. Figures are
neither checked nor written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kiln.codegen import autotune

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bench_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # for bench_meta and attention, as when run as a script
    monkeypatch.chdir(tmp_path)  # a stray write would land here, and is checked for
    return tmp_path


def test_attention_smoke_checks_kiln_against_sdpa_and_writes_nothing(bench_path, capsys):
    mod = _load("attention")
    assert mod.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "smoke: 8 rows equal SDPA" in out and "tuned" in out
    assert not autotune.timer_injected()  # the smoke run's timer does not leak into later tests
    assert not any(bench_path.rglob("*.json"))


def test_decode_attention_smoke_checks_kiln_against_sdpa_and_writes_nothing(bench_path, capsys):
    mod = _load("decode_attention")
    assert mod.main(["--smoke"]) == 0
    assert "smoke: 4 rows equal SDPA" in capsys.readouterr().out
    assert not any(bench_path.rglob("*.json"))


def test_without_cuda_the_real_runs_refuse(bench_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run would measure")
    assert _load("attention").main([]) == 2
    assert _load("decode_attention").main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
