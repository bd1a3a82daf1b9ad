"""bench/mod_speed.py: its threshold calibration (bench/mod_twins.py), and its --smoke run on CPU (figures checked
for shape, never speed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from kiln.ir.frontend import build_graph, random_weights
from kiln.spec.loader import load_spec
from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("mod_speed.py", monkeypatch)
    yield mod
    for sibling in ("mod_twins", "mod_workloads"):
        sys.modules.pop(sibling, None)


def _masks(gm: fx.GraphModule, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every threshold mask of the causal form, in layer order."""
    seen = []

    class Tap(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and n.target is torch.ops.kiln.mod_threshold_mask.default:
                seen.append(out)
            return out

    with torch.no_grad():
        Tap(gm).run(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
    return seen


def test_calibration_routes_the_capacity_share_in_every_layer(bench):
    import mod_twins  # bench/, on sys.path through the fixture

    cfg = mod_twins.routed_twin(load_spec("tiny-llama-mod").model, 0.25, 2)
    weights = mod_twins.router_weights(cfg, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    dense = {k: v for k, v in random_weights(cfg, seed=3).items() if ".router." not in k}
    gm = build_graph(cfg, {**dense, **weights})
    tokens = torch.randint(0, cfg.vocab, (4, 50), generator=torch.Generator().manual_seed(1))
    before = [m.float().mean().item() for m in _masks(gm, tokens)]
    thresholds = mod_twins.calibrate(gm, cfg, tokens)
    assert sorted(thresholds) == ["layers.1.router.threshold", "layers.3.router.threshold"]
    after = _masks(gm, tokens)
    n = tokens.numel()
    for frac in (m.float().mean().item() for m in after):  # r > the 0.75 quantile: a quarter, give or take a token
        assert abs(frac - 0.25) <= 1.5 / n, (frac, before)
    assert all(b > 0.5 for b in before), before  # threshold 0 under scores near 1 (bias 1): most tokens routed


def test_mod_speed_smoke_writes_every_workload(bench, tmp_path):
    result = bench.main(["--smoke", "--save-smoke", "--out-dir", str(tmp_path)])
    import kiln.passes.kv_cache_routed as kv_cache_routed

    assert result["smoke"] and result["capacity"] == 0.125 and result["routed_layers"] == [1]
    # --smoke narrows the routed body on its prefill steps (the GPU run's path), and leaves the knob as it was
    assert (result["narrow_min_rows"], result["narrow_bucket"]) == (16, 8)
    assert (kv_cache_routed.NARROW_MIN_ROWS, kv_cache_routed.NARROW_BUCKET) == (256, 64)
    assert list(result["thresholds"]) == ["layers.1.router.threshold"]
    assert [r["workload"] for r in result["rows"]] == ["prefill", "decode_1", "decode_3", "decode_3_p20"]
    assert [r["prompt_len"] for r in result["rows"][2:]] == [12, 20] and "target" not in result["rows"][-1]
    assert bench.batch_prompt("64:2048") == (64, 2048)
    for bad in ("64", "0:5", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCH:PROMPT_LEN|>= 1"):
            bench.batch_prompt(bad)
    for row in result["rows"]:
        dense, routed = row["dense"], row["routed"]
        assert dense["tok_s"] > 0 and routed["tok_s"] > 0 and dense["preemptions"] == routed["preemptions"] == 0
        assert row["routed_over_dense"] == round(routed["tok_s"] / dense["tok_s"], 3)
        assert dense["routed_fraction"] == {} and set(routed["routed_fraction"]) == {"1"}
        frac = routed["routed_fraction"]["1"]
        assert 0 <= frac <= 1
        # tiny-llama: one dense layer and one routed one, so a token costs (1 + fraction) layers of K/V
        assert routed["kv_bytes_per_token"] == pytest.approx(dense["kv_bytes_per_token"] * (1 + frac) / 2, abs=0.1)
        if row["new_tokens"] > 1:
            assert dense["decode_s"] > 0 and 0 < routed["kv_bytes_at_decode_start"] <= dense["kv_bytes_at_decode_start"]
            assert dense["bandwidth_share"] > 0
            # the bytes a step must read: weights alike on both sides, the routed side's K/V no more than dense
            w = result["weight_bytes"]
            assert w < routed["bytes_per_step"] <= dense["bytes_per_step"]
            assert dense["bytes_per_step"] == round(w + row["prompts"] * (row["prompt_len"] + row["new_tokens"] / 2)
                                                    * dense["kv_bytes_per_token"])
            assert row["routed_over_dense_bytes_bound"] == round(dense["bytes_per_step"] / routed["bytes_per_step"], 3)
            # the dense twin again without async scheduling (on CPU none of them schedules ahead by default)
            sync = row["dense_sync"]
            assert sync["tok_s"] > 0 and not sync["async_scheduling"] and not routed["async_scheduling"]
            assert row["routed_over_dense_sync"] == round(routed["tok_s"] / sync["tok_s"], 3)
        else:
            assert "dense_sync" not in row and "routed_over_dense_sync" not in row
    prefill = result["rows"][0]
    assert prefill["routed_padded"]["tok_s"] > 0 and "routed_padded" not in result["rows"][1]
    # the same model and prompts with narrowing off: the same routing decisions
    assert prefill["routed_padded"]["routed_fraction"] == prefill["routed"]["routed_fraction"]
    saved = json.loads(next(tmp_path.glob("mod_speed-tiny-llama-smoke-*.json")).read_text())
    assert saved["rows"] == result["rows"] and saved["torch"] and saved["commit"]


def test_mod_speed_smoke_writes_no_file_without_save_smoke(bench, tmp_path, monkeypatch):
    """Like every bench script's --smoke: nothing is written (bench/results/ included) unless --save-smoke. The
    engine runs are stubbed: the test above runs them."""
    monkeypatch.setattr(bench, "measure", lambda *a: {"tok_s": 1.0, "kv_bytes_per_token": 1.0, "routed_fraction": {}})
    written = []
    monkeypatch.setattr(bench, "write_json", lambda path, data: written.append(path))
    result = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    assert result["smoke"] and len(result["rows"]) == 4
    assert written == [] and list(tmp_path.iterdir()) == []


def test_routed_rows_are_counted_after_replays_and_without_padding(bench):
    """mod_speed's routed fractions count every step the runner records: a replayed CUDA graph never calls the
    model (mimicked here by a _replay that runs the inner step directly) and a padded step's padding rows are not
    tokens. The padded, replayed run must count what the plain run counts, every token fed once."""
    import mod_twins

    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    cpu = torch.device("cpu")
    graphs, _ = mod_twins.build_twins("tiny-llama", 0.5, 2, "fp32", cpu, seed=0, calib=(2, 16), copies=1)
    rcfg, rcomp, rgm = graphs[1]
    prompts = torch.randint(0, rcfg.vocab, (3, 9), generator=torch.Generator().manual_seed(5)).tolist()
    max_tokens = 6
    counted = []
    for replayed in (False, True):
        step = mod_twins.compile_side(rcfg, rcomp, rgm, cpu, knobs=(mod_twins.NEVER, 8))
        engine = Engine(step, None, rcfg, num_blocks=64, routed_num_blocks=64, max_num_seqs=4,
                        max_num_batched_tokens=64, pad_decode_batches=replayed)
        step.watch(engine.block_manager)
        if replayed:
            engine.runner._replay = lambda batch, e=engine, inner=step.step: inner(batch, e.runner.kv_cache)
        for p in prompts:
            engine.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
        engine.run()
        assert step.rows == len(prompts) * (9 + max_tokens - 1)  # each prompt token and each fed-back token once
        counted.append(step.fractions([1]))
    assert counted[0] == counted[1] and 0 < counted[0]["1"] < 1, counted


def test_a_side_that_raises_is_its_error_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    """The dense twin without async scheduling fails on every decode workload: each row keeps the other sides and
    their ratio, the failed side holds its error (collect.py reports it), and the file says complete at the end."""
    def measure(step, cfg, w, *rest):
        if w.async_scheduling is False:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"tok_s": 2.0 if getattr(step, "num_routed_layers", 0) else 1.0, "kv_bytes_per_token": 1.0,
                "routed_fraction": {}}

    monkeypatch.setattr(bench, "measure", measure)
    result = bench.main(["--smoke", "--save-smoke", "--out-dir", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("mod_speed-*.json")).read_text())
    assert saved["status"] == "complete" and saved["rows"] == result["rows"] and len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["routed_over_dense"] == 2.0
        if row["new_tokens"] > 1:
            assert row["dense_sync"] == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
            assert "routed_over_dense_sync" not in row and row["routed_over_dense_bytes_bound"] > 0
