"""`kiln bench throughput` and bench/kv_cache.py on tiny settings (figures are checked for shape, never speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.cli.commands import main
from kiln.runtime.throughput import make_trace, parse_range
from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_parse_range_and_seeded_trace():
    assert parse_range("100:1024") == (100, 1024) and parse_range("8") == (8, 8)
    with pytest.raises(ValueError):
        parse_range("9:3")
    a, clipped = make_trace(20, (10, 200), (10, 200), vocab=50, context=256, seed=3)
    b, _ = make_trace(20, (10, 200), (10, 200), vocab=50, context=256, seed=3)
    assert a == b and clipped > 0
    assert all(len(r.prompt_token_ids) + r.output_len <= 256 and r.output_len >= 1 for r in a)
    assert a != make_trace(20, (10, 200), (10, 200), vocab=50, context=256, seed=4)[0]


def test_bench_throughput_reports_both_policies(capsys):
    code = main(["bench", "throughput", "tiny-llama", "--num-requests", "10", "--input-len", "4:40",
                 "--output-len", "2:12", "--max-num-seqs", "4", "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    r = json.loads(out)
    assert r["device"].startswith("cpu") and r["trace"]["num_requests"] == 10 and r["model"] == "tiny-llama"
    trace = r["trace"]
    for policy in ("continuous", "static"):
        m = r[policy]
        elapsed = m["elapsed_s"]
        assert elapsed > 0
        # every figure is the trace's count over the same elapsed time (outputs have exactly their length)
        assert m["requests_per_s"] == pytest.approx(trace["num_requests"] / elapsed, rel=1e-12)
        assert m["output_tokens_per_s"] == pytest.approx(trace["output_tokens"] / elapsed, rel=1e-12)
        assert m["total_tokens_per_s"] == pytest.approx((trace["prompt_tokens"] + trace["output_tokens"]) / elapsed,
                                                        rel=1e-12)
        t, p = m["ttft_s"], m["tpot_s"]
        assert set(t) == set(p) == {"mean", "p50", "p99"}
        # latencies from the run's start: within the run, p99 of 10 values is the largest, so the mean is below it
        assert 0 < t["p50"] <= t["p99"] <= elapsed and 0 < t["mean"] <= t["p99"]
        assert 0 < p["p50"] <= p["p99"] <= elapsed and 0 < p["mean"] <= p["p99"]
        assert m["batched_tokens"] >= trace["prompt_tokens"] + trace["output_tokens"] - trace["num_requests"]
    c, st = r["continuous"], r["static"]
    # The static baseline cannot refill seats, so it needs at least as many steps for the same tokens.
    assert st["steps"] >= c["steps"]
    # continuous over static from the same figures (TTFT: static's mean over continuous's, "x lower")
    assert r["speedup"] == {"output_tokens_per_s": c["output_tokens_per_s"] / st["output_tokens_per_s"],
                            "requests_per_s": c["requests_per_s"] / st["requests_per_s"],
                            "ttft_mean": st["ttft_s"]["mean"] / c["ttft_s"]["mean"]}
    assert "bench continuous" in err


def test_bench_throughput_plain_table_and_bad_flags(capsys):
    assert main(["bench", "throughput", "tiny-llama", "--num-requests", "3", "--input-len", "4:8",
                 "--output-len", "2:3", "--device", "cpu"]) == 0
    out = capsys.readouterr()[0]
    assert "continuous" in out and "static" in out and "TTFT" in out
    assert main(["bench", "throughput", "tiny-llama", "--input-len", "9:3"]) == 2
    assert "--input-len" in capsys.readouterr()[1]


def test_kv_cache_bench_writes_its_json(tmp_path, monkeypatch):
    mod = load_script("kv_cache.py", monkeypatch)
    assert mod.main(["--tokens", "12", "--prompt-len", "40", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    files = list(tmp_path.glob("kv_cache-tiny-llama-cpu-*.json"))
    assert len(files) == 1
    r = json.loads(files[0].read_text())
    assert r["same_tokens"] and r["tokens"] == 12 and r["ratio"] > 0
    assert r["cached"]["prompt_tokens_from_prefix_cache"] == 0  # the warm-up's prompt is not reused
    assert {"torch", "triton", "commit", "date", "device"} <= set(r)


def test_speculative_bench_runs_a_spec_with_random_weights(tmp_path, monkeypatch):
    """The GPU run's form (a spec without a tokenizer: seeded copying prompts), at the tiniest setting."""
    mod = load_script("speculative.py", monkeypatch)
    argv = ["--spec", "tiny-llama", "--batches", "2", "--new-tokens", "4", "--self-layers", "1", "--repeats",
            "1", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert mod.main(argv) == 0
    # the spec is in the name: the GPU session runs two specs into one folder on one day
    [path] = tmp_path.glob("speculative-*.json")
    assert path.name.startswith("speculative-tiny-llama-")
    r = json.loads(path.read_text())
    assert r["status"] == "complete" and r["errors"] == []
    assert "random weights" in r["workload"] and r["prompt_tokens"] == [128] * 4
    assert r["spec"] == "tiny-llama" and r["weights"] == "random"  # tiny-llama bundles no weights
    rows = r["results"]
    assert {(x["batch"], x["drafter"]) for x in rows} == {(b, d) for b in (2,) for d in ("none", "ngram", "self")}
    assert all(x["same_tokens_as_plain"] for x in rows)
    # Random weights rarely copy, so n-gram lookup may find nothing to propose; the self drafter always drafts.
    assert all(x["proposed"] > 0 for x in rows if x["drafter"] == "self")
    assert all(x["proposed"] == 0 for x in rows if x["drafter"] == "none")
    # timed from the step where both requests have their first token (the prefill is no drafter's work)
    assert all(x["timed_tokens"] == 2 * (4 - 1) for x in rows)
    assert all(x["tokens_per_s"] == pytest.approx(x["timed_tokens"] / x["seconds"], rel=0.01) for x in rows)
    assert r["commit"] and r["device"]  # the run metadata at the top, where collect.py reads the commit


def test_speculative_bench_records_a_failing_drafter_and_saves_every_row_as_it_ends(tmp_path, monkeypatch):
    mod = load_script("speculative.py", monkeypatch)

    def no_self_drafter(*args, **kwargs):  # the self drafter's engine fails to build at every batch
        raise RuntimeError("CUDA graph capture failed")

    real_run, seen = mod.run, []

    def run(engine, reqs, new_tokens):
        name = type(engine.drafter).__name__
        if new_tokens > 2 and len(reqs) == 1 and name == "NgramDrafter":
            raise RuntimeError("illegal memory access")  # n-gram's timed run at batch 1
        if new_tokens > 2 and len(reqs) == 2 and name == "NoneType":  # batch 2's first timed run: batch 1 is saved
            saved = json.loads(next(tmp_path.glob("speculative-*.json")).read_text())
            seen.append((saved["status"], [(r["batch"], r["drafter"], "error" in r) for r in saved["results"]]))
        return real_run(engine, reqs, new_tokens)

    monkeypatch.setattr(mod, "ModelDrafter", no_self_drafter)
    monkeypatch.setattr(mod, "run", run)
    argv = ["--spec", "tiny-llama", "--batches", "1", "2", "--new-tokens", "4", "--self-layers", "1", "--repeats",
            "1", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert mod.main(argv) == 1
    # on disk before batch 2's timed runs, marked partial (collect.py flags a status short of complete)
    assert seen == [("partial: 4 of 6 (batch, drafter) rows recorded",
                     [(1, "self", True), (1, "none", False), (1, "ngram", True), (2, "self", True)])]
    r = json.loads(next(tmp_path.glob("speculative-*.json")).read_text())
    assert r["status"] == "complete"
    rows = {(x["batch"], x["drafter"]): x for x in r["results"]}
    assert len(rows) == len(r["results"]) == 6
    assert rows[(1, "ngram")] == {"batch": 1, "drafter": "ngram", "error": "RuntimeError: illegal memory access"}
    for b in (1, 2):
        assert rows[(b, "self")] == {"batch": b, "drafter": "self", "error": "RuntimeError: CUDA graph capture failed"}
        assert rows[(b, "none")]["tokens_per_s"] > 0 and rows[(b, "none")]["speedup"] == 1.0
    assert rows[(2, "ngram")]["tokens_per_s"] > 0 and rows[(2, "ngram")]["same_tokens_as_plain"] is True
    assert r["errors"] == [x for x in r["results"] if "error" in x] and len(r["errors"]) == 3
    assert set(r["crossover"]) == {"ngram", "self"} and r["crossover"]["self"] == 0


@pytest.mark.parametrize("broken", ["load_model", "compile_step"])
def test_speculative_bench_writes_a_failed_run_when_the_target_cannot_run(tmp_path, monkeypatch, broken):
    mod = load_script("speculative.py", monkeypatch)

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(mod, broken, fail)
    argv = ["--spec", "tiny-llama", "--batches", "1", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert mod.main(argv) == 1
    r = json.loads(next(tmp_path.glob("speculative-tiny-llama-*.json")).read_text())
    what = {"load_model": "did not load", "compile_step": "did not compile"}[broken]
    assert r["status"] == f"failed: the target model {what}: RuntimeError: CUDA out of memory"
    assert r["results"] == [] and r["commit"]


def _host_step(monkeypatch):
    mod = load_script("host_step.py", monkeypatch)
    return mod


def test_host_step_bench_times_the_runtime_without_a_model(tmp_path, monkeypatch):
    mod = _host_step(monkeypatch)
    prof = tmp_path / "prof.txt"
    result = mod.main(["--seqs", "1", "3", "--steps", "5", "--prompt-len", "9", "--vocab", "300", "--detokenize",
                       "--profile", str(prof), "--out-dir", str(tmp_path)])
    assert [r["seqs"] for r in result["rows"]] == [1, 3]
    assert all(r["step_ms_median"] > 0 and r["step_ms_p90"] >= r["step_ms_median"] for r in result["rows"])
    for r in result["rows"]:  # overlap on: the output work is part of the step, the critical path the rest
        assert 0 < r["overlap_output_ms_median"] < r["overlap_step_ms_median"] <= r["overlap_step_ms_p90"]
        assert 0 < r["overlap_critical_ms_median"] < r["overlap_step_ms_p90"]
    assert "synchronous" in result["note"]
    assert "engine.py" in prof.read_text()  # the profile covers the engine's step
    assert json.loads(next(tmp_path.glob("host_step-*.json")).read_text())["rows"] == result["rows"]
    final = mod.main(["--seqs", "3", "--steps", "4", "--prompt-len", "5", "--vocab", "300", "--detokenize",
                      "--output-kind", "final_only", "--tag", "final", "--out-dir", str(tmp_path)])
    assert [r["output_kind"] for r in final["rows"]] == ["final_only"]
    assert all(r["all_ms_per_step"] > 0 for r in result["rows"] + final["rows"])
    assert result["rows"][0]["output_kind"] == "cumulative"


def test_host_step_bench_runs_a_routed_spec_beside_its_dense_twin(tmp_path, monkeypatch):
    mod = _host_step(monkeypatch)
    assert mod.spec_shape("tiny-llama-mod", None, None) == mod.Shape("tiny-llama-mod", 2, 2, 0.5, 2)
    assert mod.spec_shape("llama-3.2-1b", 0.125, 2) == mod.Shape("llama-3.2-1b", 8, 8, 0.125, 2)
    assert mod.spec_shape("llama-3.2-1b", None, None) == mod.Shape("llama-3.2-1b", 16)
    prof = tmp_path / "prof.txt"
    result = mod.main(["--spec", "llama-3.2-1b", "--capacity", "0.125", "--every", "2", "--seqs", "1", "3",
                       "--steps", "5", "--prompt-len", "9", "--vocab", "300", "--tag", "t", "--profile", str(prof),
                       "--repeat", "3", "--out-dir", str(tmp_path)])
    assert [(r["seqs"], r["model"], r["layers"], r["routed_layers"]) for r in result["rows"]] == [
        (1, "dense", 16, 0), (1, "routed", 8, 8), (3, "dense", 16, 0), (3, "routed", 8, 8)]
    for r in result["rows"]:  # the figures are the medians of the repeats
        for k, values in r["repeats"].items():
            assert len(values) == 3 and r[k] == sorted(values)[1]
    for dense, routed in zip(result["rows"][::2], result["rows"][1::2], strict=True):
        assert routed["routed_over_dense"]["step_ms_median"] == round(routed["step_ms_median"]
                                                                      / dense["step_ms_median"], 3)
    assert result["capacity"] == 0.125 and result["every"] == 2 and "routed_blocks.py" in prof.read_text()
    assert json.loads(next(tmp_path.glob("host_step-routed-t-*.json")).read_text())["rows"] == result["rows"]
    with pytest.raises(SystemExit, match="give --spec too"):
        mod.main(["--capacity", "0.5"])


def test_the_null_models_routing_pattern_is_fixed_and_near_its_capacity(monkeypatch):
    from kiln.step import StepBatch

    mod = _host_step(monkeypatch)
    model = mod.NullModel(50, num_routed_layers=3, routed_capacity=0.125)
    n = 4000
    pos = torch.arange(n) % 700
    batch = StepBatch(torch.zeros(n, dtype=torch.long), pos, pos, torch.zeros(1, 1, dtype=torch.int32),
                      torch.ones(1, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                      torch.tensor([n - 1]), n, n)
    logits, routed = model(batch, None)
    assert logits.shape == (1, 50) and routed.shape == (3, n) and routed.dtype == torch.int32
    assert all(abs(f - 0.125) < 0.03 for f in routed.float().mean(1).tolist())
    assert len({tuple(r.tolist()) for r in routed}) == 3  # the layers route differently
    assert torch.equal(routed, mod.NullModel(50, num_routed_layers=3, routed_capacity=0.125)(batch, None)[1])
    assert mod.NullModel(50)(batch, None).shape == (1, 50)  # a dense null model returns the logits alone


def test_pipeline_sim_hides_the_host_behind_the_device_only_with_async_scheduling(tmp_path, monkeypatch):
    """A simulated device step of 100 ms, far longer than a step's host work here even on a loaded machine (at 40 ms
    a busy 2-core run once let an async launch find the device idle): synchronous steps and overlapped
    outputs launch every step onto an idle device (the host schedules it only after reading the last one's ids),
    async scheduling none (each step is queued before the last one ends)."""
    mod = load_script("pipeline_sim.py", monkeypatch)
    result = mod.main(["--seqs", "1", "3", "--steps", "6", "--prompt-len", "9", "--vocab", "300", "--detokenize",
                       "--device-ms", "100", "--out-dir", str(tmp_path)])
    rows = {(r["mode"], r["seqs"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((m, n) for m in ("sync", "overlap", "async") for n in (1, 3))
    for n in (1, 3):
        assert rows["sync", n]["idle_launches"] == rows["overlap", n]["idle_launches"] == 6
        assert rows["async", n]["idle_launches"] == 0 and rows["async", n]["steps_ahead"] >= 6
        assert rows["sync", n]["steps_ahead"] == rows["overlap", n]["steps_ahead"] == 0
        assert rows["sync", n]["step_ms_median"] > 100 and rows["async", n]["step_ms_median"] > 99.5
    assert json.loads(next(tmp_path.glob("pipeline_sim-*.json")).read_text())["rows"] == result["rows"]


def test_step_host_time_runs_on_cpu_and_builds_a_consistent_decode_batch(tmp_path, monkeypatch):
    mod = load_script("step_host_time.py", monkeypatch)
    b = mod.decode_batch(3, 37, 16, 50, torch.device("cpu"))
    assert b.block_tables.shape == (3, 3) and len(set(b.block_tables.flatten().tolist())) == 9
    assert 0 not in b.block_tables.tolist()[0]  # the null block is nobody's
    assert b.slot_mapping.tolist() == [int(t[2]) * 16 + 4 for t in b.block_tables]  # position 36: block 2, slot 4
    assert b.positions.tolist() == [36] * 3 and b.context_lens.tolist() == [37] * 3
    result = mod.main(["--smoke", "--save-smoke", "--out-dir", str(tmp_path)])
    assert [r["batch"] for r in result["rows"]] == [1, 3] and result["smoke"]
    for r in result["rows"]:
        assert 0 < r["host_ms"] <= r["wall_ms"] and r["profiler_cpu_ms_per_step"] > 0
        assert r["device_ms"] is None and r["kernel_launches_per_step"] is None  # no CUDA here
    assert result["kiln_path"] == str(ROOT / "compiler") and "not this checkout" not in result["commit"]
    assert json.loads(next(tmp_path.glob("step_host_time-smoke-*.json")).read_text())["rows"] == result["rows"]


def test_step_host_time_times_a_random_kv_pool(monkeypatch):
    """Device times are never taken over an all-zero pool: every tensor of the KVCache is filled (int8 codes and
    positive fp32 scales for an int8 cache)."""
    from kiln.step import KVCache

    mod = load_script("step_host_time.py", monkeypatch)
    kv = mod.random_fill(KVCache(torch.zeros(2, 2, 3, 4, 2, 8, dtype=torch.int8), torch.zeros(2, 2, 3, 4, 2)))
    assert (kv.data != 0).float().mean() > 0.9 and kv.scales.min() > 0 and kv.routed is None
    kv = mod.random_fill(KVCache(torch.zeros(2, 2, 3, 4, 2, 8, dtype=torch.bfloat16)))
    assert (kv.data != 0).float().mean() > 0.9 and kv.data.abs().max() <= 1  # bf16 may round a few to 0


def test_step_host_time_smoke_writes_no_file_without_save_smoke(tmp_path, monkeypatch):
    """Like every bench script's --smoke: nothing is written (bench/results/ included) unless --save-smoke."""
    mod = load_script("step_host_time.py", monkeypatch)
    written = []
    monkeypatch.setattr(mod, "write_json", lambda path, data: written.append(path))
    assert mod.main(["--smoke", "--out-dir", str(tmp_path)])["smoke"]
    assert written == [] and list(tmp_path.iterdir()) == []
