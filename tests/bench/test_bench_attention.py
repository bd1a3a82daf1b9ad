"""bench/attention.py and bench/decode_attention.py in --smoke mode (Triton's interpreter, tiny shapes): every
code path of the GPU runs except CUDA timing, so the GPU session does not discover a typo. Figures are
neither checked nor written."""

from __future__ import annotations

import importlib.util
import json
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


def test_a_wrong_tma_variant_is_recorded_and_fails_the_run_at_the_end(bench_path, monkeypatch, capsys):
    from kiln.codegen import flash_attn

    real = flash_attn.flash_attention

    def wrong_tma(*args, tma, **kwargs):
        out = real(*args, tma=tma, **kwargs)
        return out + 1 if tma else out

    monkeypatch.setattr(flash_attn, "flash_attention", wrong_tma)
    assert _load("attention").main(["--smoke", "--save-smoke", "--out", str(bench_path / "r")]) == 1
    rows = json.loads(next((bench_path / "r").glob("attention-*.json")).read_text())["rows"]
    assert len(rows) == 8  # every row still measured, kiln itself in each
    for row in rows:
        assert row["kiln_tma_error"].startswith("mismatch ") and "kiln_tma_ms" not in row and row["kiln_ms"] > 0
    assert capsys.readouterr().err.count("MISMATCH config") == 8


def test_attention_rows_are_on_disk_before_the_run_ends(bench_path, monkeypatch):
    mod = _load("attention")
    real, calls = mod.measure, []

    def dies_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise SystemExit("kiln's output differs from SDPA")  # what measure raises for kiln itself
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "measure", dies_third)
    with pytest.raises(SystemExit, match="differs"):
        mod.main(["--smoke", "--save-smoke", "--tma", "off", "--out", str(bench_path / "r")])
    saved = json.loads(next((bench_path / "r").glob("attention-*.json")).read_text())
    assert [r["seq"] for r in saved["rows"]] == [33, 40] and saved["benchmark"] == "attention"


def test_decode_attention_smoke_checks_kiln_against_sdpa_and_writes_nothing(bench_path, capsys):
    mod = _load("decode_attention")
    assert mod.main(["--smoke"]) == 0
    assert "smoke: 4 rows equal SDPA" in capsys.readouterr().out
    assert not any(bench_path.rglob("*.json"))


def test_a_wrong_decode_row_is_recorded_the_rest_run_and_the_run_fails_at_the_end(bench_path, monkeypatch, capsys):
    from kiln.codegen import paged

    real = paged.paged_attention_decode

    def wrong_at_batch_3_ctx_40(q, cache, layer, tables, context_lens, qsl, max_ctx, *args, **kwargs):
        out = real(q, cache, layer, tables, context_lens, qsl, max_ctx, *args, **kwargs)
        return out + 1 if (q.shape[0], max_ctx) == (3, 40) else out

    monkeypatch.setattr(paged, "paged_attention_decode", wrong_at_batch_3_ctx_40)
    mod = _load("decode_attention")
    real_measure, calls = mod.measure, []

    def measure(cfg, batch, ctx, *args):
        calls.append((batch, ctx))
        if (batch, ctx) == (1, 77):
            raise RuntimeError("out of resources")
        return real_measure(cfg, batch, ctx, *args)

    monkeypatch.setattr(mod, "measure", measure)
    assert mod.main(["--smoke", "--save-smoke", "--out", str(bench_path / "r")]) == 1
    assert calls == [(1, 40), (1, 77), (3, 40), (3, 77)]  # every point ran
    saved = json.loads(next((bench_path / "r").glob("decode_attention-*.json")).read_text())
    rows = {(r["batch"], r["context"]): r for r in saved["rows"]}
    assert rows[(1, 77)]["error"] == "RuntimeError: out of resources"
    assert rows[(3, 40)]["error"].startswith("mismatch ") and "kiln_ms" not in rows[(3, 40)]
    assert rows[(1, 40)]["kiln_ms"] > 0 and rows[(3, 77)]["kiln_ms"] > 0
    assert saved["errors"] == [rows[(1, 77)], rows[(3, 40)]]
    assert "FAILED: 2 of 4 rows" in capsys.readouterr().err


def test_decode_attention_rows_are_on_disk_before_the_run_ends(bench_path, monkeypatch):
    mod = _load("decode_attention")
    real, calls = mod.measure, []

    def killed_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a timeout's kill would: nothing after this runs
        return real(*args)

    monkeypatch.setattr(mod, "measure", killed_third)
    with pytest.raises(KeyboardInterrupt):
        mod.main(["--smoke", "--save-smoke", "--out", str(bench_path / "r")])
    saved = json.loads(next((bench_path / "r").glob("decode_attention-*.json")).read_text())
    assert [(r["batch"], r["context"]) for r in saved["rows"]] == [(1, 40), (1, 77)] and not saved["errors"]


def test_without_cuda_the_real_runs_refuse(bench_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run would measure")
    assert _load("attention").main([]) == 2
    assert _load("decode_attention").main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_failing_tune_is_recorded_for_its_head_dim_and_the_next_head_dim_runs(bench_path, monkeypatch, capsys):
    mod = _load("decode_attention")
    real = mod.tune

    def tune(cfg, *args):
        if cfg["head_dim"] == 32:
            raise RuntimeError("CodegenError: every candidate failed")
        return real(cfg, *args)

    monkeypatch.setattr(mod, "tune", tune)
    assert mod.main(["--smoke", "--save-smoke", "--head-dims", "32,64", "--out", str(bench_path / "r")]) == 1
    saved = json.loads(next((bench_path / "r").glob("decode_attention-*.json")).read_text())
    error = "tune: RuntimeError: CodegenError: every candidate failed"
    assert saved["config"]["tiles_by_head_dim"]["32"] == {"error": error}
    assert "block_n" in saved["config"]["tiles_by_head_dim"]["64"]
    assert saved["errors"] == [{"head_dim": 32, "error": error}]
    # head dim 64 measured every point; 32 none
    assert sorted((r["head_dim"], r["batch"], r["context"]) for r in saved["rows"]) == [
        (64, 1, 40), (64, 1, 77), (64, 3, 40), (64, 3, 77)]
    assert all(r["kiln_ms"] > 0 for r in saved["rows"])
    assert "FAILED: tuning for head dim 32" in capsys.readouterr().err


def test_decode_target_is_met_only_in_every_head_dim(bench_path):
    """target_met needs batch 64, context 4096 at >= 70% of copy bandwidth in every head dim of the run: a head dim
    whose row failed, or that has no row (its tuning failed), does not meet it; None where no head dim has the point."""
    import argparse

    mod = _load("decode_attention")
    args = argparse.Namespace(heads=32, kv_heads=8, block_size=16, dtype="bf16", head_dims="64,128")

    def met(rows):
        return mod._result(args, {}, {}, (64, 4096), rows, [], 3e12, [])["target_met"]

    def row(d, share=0.8, **kw):
        return {"batch": 64, "context": 4096, "head_dim": d, "kiln_of_copy_bw": share, **kw}

    assert met([row(64), row(128)]) is True
    assert met([row(64), row(128, share=0.6)]) is False
    assert met([row(64)]) is False  # head dim 128 measured nothing
    assert met([row(64), {"batch": 64, "context": 4096, "head_dim": 128, "error": "mismatch 0.3"}]) is False
    assert met([{**row(64), "context": 512}]) is None
