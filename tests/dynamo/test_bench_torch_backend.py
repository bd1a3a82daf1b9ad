"""bench/torch_backend.py in its --smoke mode: a tiny Llama through every code path the GPU run takes (kiln with
inductor and mode="reduce-overhead", the static-cache decode step), checked against eager; no figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # for bench_meta, as when run as a script
    monkeypatch.setenv("KILN_DEBUG", "0")
    spec = importlib.util.spec_from_file_location("torch_backend_bench", ROOT / "bench" / "torch_backend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    torch._dynamo.reset()


def test_smoke_checks_kiln_with_reduce_overhead_against_eager(bench, capsys, tmp_path):
    argv = ["--smoke", "--variants", "eager,kiln-ro", "--explain", "--explain-baselines", "eager"]
    assert bench.main([*argv, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kiln-ro  prefill:" in out and "kiln-ro   decode:" in out
    assert "  timing of graph" in out and "    region 0 " in out and "    rest " in out
    assert "smoke: 2 variant(s) x 2 workloads checked against eager; no figures written" in out
    assert "Dynamo graphs per variant: {'eager': 0, 'kiln-ro': 2}" in out  # prefill and decode, no recompile
    assert list(tmp_path.iterdir()) == []


def test_without_cuda_or_with_bad_variants_there_are_no_figures(bench, capsys):
    assert bench.main(["--smoke", "--variants", "kiln"]) == 2  # eager is the reference: required
    assert bench.main(["--smoke", "--variants", "eager,kiln-fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("choose among eager, inductor, inductor-ro, kiln, kiln-ro, kiln-eager") == 2
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "needs a CUDA device for figures" in capsys.readouterr().err


def test_a_mismatch_fails_the_smoke_run(bench, monkeypatch, capsys):
    wrong = bench.compiled_forward

    def off_by_one(model, variant, options):
        assert options == {"claims": {"attention": False}}
        f = wrong(model, variant, options)
        if variant == "eager":
            return f

        def shifted(*args, **kwargs):
            out = f(*args, **kwargs)
            out.logits = out.logits + 1
            return out

        return shifted

    monkeypatch.setattr(bench, "compiled_forward", off_by_one)
    options = '{"claims": {"attention": false}}'  # and --kiln-options reaches the kiln variant
    assert bench.main(["--smoke", "--variants", "eager,kiln-eager", "--kiln-options", options]) == 1
    assert "MISMATCH kiln-eager prefill: relative error" in capsys.readouterr().err
