"""bench/torch_backend.py in its --smoke mode: a tiny Llama through every code path the GPU run takes (kiln with
inductor and mode="reduce-overhead", the static-cache decode step), checked against eager; no figures. And its
failure handling (--save-smoke writes the JSON the GPU run writes): a variant that raises is recorded and the next
one still runs, the JSON is on disk before --explain runs, and any error makes the exit code 1."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench_scripts import load_script


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("KILN_DEBUG", "0")
    yield load_script("torch_backend.py", monkeypatch)
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


def test_a_failing_variant_and_explain_are_recorded_and_the_rest_is_saved(bench, monkeypatch, tmp_path, capsys):
    real = bench.compiled_forward

    def kiln_breaks(model, variant, options):
        if variant == "kiln":
            raise RuntimeError("kiln backend failed to compile")
        return real(model, variant, options)

    seen_before_explain = []

    def explain_breaks(*args, **kwargs):
        [path] = tmp_path.glob("torch_backend-*.json")
        seen_before_explain.append(json.loads(path.read_text()))
        raise MemoryError("explain ran out of memory")

    monkeypatch.setattr(bench, "compiled_forward", kiln_breaks)
    monkeypatch.setattr(bench, "explain_text", explain_breaks)
    argv = ["--smoke", "--save-smoke", "--variants", "kiln,eager", "--explain", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 1
    [early] = seen_before_explain
    assert early["errors"] == {"kiln": "RuntimeError: kiln backend failed to compile"}
    assert early["results"]["eager"]["prefill"]["median_ms"] > 0  # the variant after the failing one ran
    assert early["explain_prefill"] == "not yet run"
    [path] = tmp_path.glob("torch_backend-*.json")
    final = json.loads(path.read_text())
    assert final["errors"] == {"kiln": "RuntimeError: kiln backend failed to compile",
                               "explain": "MemoryError: explain ran out of memory"}
    assert set(final["results"]["eager"]) == {"prefill", "decode"} and final["results"]["kiln"] == {}
    assert "explain_prefill" not in final
    err = capsys.readouterr().err
    assert "ERROR kiln: RuntimeError" in err and "ERROR explain: MemoryError" in err
