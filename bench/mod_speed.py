"""Mixture-of-Depths speed (issue 13): prefill and decode tokens/s of a routed model against its dense twin, through
kiln's engine, in the same run.

    python bench/mod_speed.py [SPEC] [--capacity 0.125] [--every 2] [--prefill-prompts 64] [--prefill-len 2048]
                              [--decode-batches 1 64] [--decode-prompt 512] [--new-tokens 256] [--temperature 1]
                              [--max-num-batched-tokens 16384] [--narrow-min-rows 256] [--narrow-bucket 64]
                              [--calib-prompts 8] [--calib-len 512] [--dtype bf16] [--device auto] [--copy-mib 1024]
                              [--padded-prefill] [--eager] [--prefix-caching] [--extra-decode B:P ...]
                              [--out-dir DIR]
    python bench/mod_speed.py --smoke      # CPU, tiny-llama, reference ops: the plumbing only, no figures, no file
                                           # (--save-smoke: the file too)

The dense twin is SPEC (default llama-3.2-1b) with seeded random weights generated on the device; the routed
model is the same ModelConfig with route = mod(capacity, every, decide = threshold) on the same tensors plus one
router per routed layer (weight N(0, 1/dim), bias 1, as kiln's random init). Its thresholds are calibrated in
layer order on the causal form (each layer sees the inputs it will see when served): one eager pass of the Level-1
graph over --calib-prompts random prompts sets each layer's threshold to the (1 - capacity) quantile of its router
scores the moment they are computed, so the later layers' scores already follow the earlier thresholds.

Measured through kiln.runtime.engine.Engine (compile_step as served: kernels on a GPU, CUDA graphs for both
models' decodes; --eager drops them for both: the routing's own effect on decode, apart from the graphs'), each
workload warmed up first on other random prompts with the same step shapes:
- prefill: --prefill-prompts prompts of --prefill-len tokens, max_tokens 1; tokens/s = prompt tokens / wall time;
- decode at each batch B: B prompts of --decode-prompt tokens, --new-tokens tokens each, EOS ignored, sampled at
  --temperature (greedy decoding of random weights falls into loops whose routing is no sample of the prompts');
  every prompt prefills in one step, so the decode interval (every request has its first token -> all done) is
  B-row decode steps only; tokens/s = tokens generated in it / its wall time;
- --extra-decode B:P (any number, run last): a decode at batch B with prompts of P tokens (row `decode_B_pP`),
  e.g. 64:2048, where the bytes bound below leaves the decode target room (at batch 64 and a mean context of 640
  tokens the bound itself is below 1.2x for llama-3.2-1b at capacity 0.125, every 2).
A decode row also runs the dense twin with async scheduling off (`dense_sync`, `routed_over_dense_sync`): how much
of the dense speed rests on hiding the host work per step, which is larger on the routed side. Each side's row says
whether it ran async.
Per workload and model: tokens/s, the routed/dense ratio, the fraction of rows each routed layer really routed
(counted from the step's `routed` output, never assumed), KV bytes per token at those fractions, and the KV
bytes the engine held when decoding started. Issue 13's targets: prefill >= 1.4x, decode at batch 64 >= 1.2x.
A decode row also has each side's bytes per step (the weights but the embedding table, plus the batch's K/V at
the mean context and the measured routed fractions) and `routed_over_dense_bytes_bound`, their ratio: what a
memory-bound decode step can gain at most, since a routed layer still reads all of its weights for the few rows
it routes.
Each engine gets an explicit pool: the workload's blocks plus a step of slack, the routed pools as large as the
dense one, because a routed layer reserves its worst case (every new token of a step routed) before each step.
Prefix caching is off unless --prefix-caching: random prompts never hit, and without it the KV bytes held count
the live requests' blocks only (a cached entry would hold routed blocks of finished requests).
The routed body's per-row work: prefill steps (N >= kv_cache_routed.NARROW_MIN_ROWS rows) run it on the routed rows
only, decode steps on all N rows (the padded path; passes/mod_routing.py says why); --narrow-min-rows moves the
line (--smoke lowers it so that its prefill steps narrow too); both knobs are in the JSON. --padded-prefill
compiles a third model, the routed one with narrowing off, and adds its prefill (`routed_padded`): what the
narrowing buys, in the same run. The JSON is rewritten after every workload, so a run cut short keeps its rows.
Writes bench/results/mod_speed-<spec>-<device>-<date>.json (metadata: bench_meta.py). The twins are mod_twins.py's,
a workload's run on one model mod_workloads.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json
from ceilings import copy_bandwidth
from mod_twins import NEVER, build_twins, compile_side, say
from mod_workloads import Workload, measure

from kiln.build import resolve_device
from kiln.compile.step import CompiledStep
from kiln.passes import kv_cache_routed

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"prefill": 1.4, "decode_64": 1.2}  # issue 13: routed over dense tokens/s
SMOKE = ["tiny-llama", "--prefill-prompts", "3", "--prefill-len", "40", "--decode-batches", "1", "3",
         "--decode-prompt", "12", "--new-tokens", "6", "--calib-prompts", "4", "--calib-len", "32",
         "--max-num-batched-tokens", "64", "--narrow-min-rows", "16", "--narrow-bucket", "8", "--dtype", "fp32",
         "--device", "cpu", "--copy-mib", "4", "--padded-prefill", "--extra-decode", "3:20"]


def batch_prompt(text: str) -> tuple[int, int]:
    """'B:P' -> (B, P), both >= 1."""
    try:
        b, p = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give BATCH:PROMPT_LEN, e.g. 64:2048") from None
    if b < 1 or p < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and prompt length must be >= 1")
    return b, p


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_bytes(step: CompiledStep, weight_bytes: int, batch: int, context: float, per_token: float) -> float:
    """Bytes one decode step must read at least: the weights (the embedding table aside) and the batch's K/V."""
    return weight_bytes + batch * context * per_token


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default="llama-3.2-1b", help="the dense twin (a bundled spec or .kiln file)")
    ap.add_argument("--capacity", type=float, default=0.125)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--prefill-prompts", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="decode sampling (0: greedy)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="the prefill engine's step budget")
    ap.add_argument("--calib-prompts", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer size of the copy-bandwidth measurement")
    ap.add_argument("--narrow-min-rows", type=int, default=kv_cache_routed.NARROW_MIN_ROWS,
                    help="steps of at least this many rows run the routed bodies on their routed rows only "
                         "(kv_cache_routed.NARROW_MIN_ROWS; a huge value keeps every step padded, for comparison)")
    ap.add_argument("--narrow-bucket", type=int, default=kv_cache_routed.NARROW_BUCKET,
                    help="the narrowed rows are rounded up to a multiple of this (kv_cache_routed.NARROW_BUCKET)")
    ap.add_argument("--padded-prefill", action="store_true",
                    help="also the routed prefill with narrowing off (a third model): what narrowing buys")
    ap.add_argument("--eager", action="store_true",
                    help="no CUDA graphs for either model: the routing's "
                         "own effect on decode, apart from the graphs'")
    ap.add_argument("--prefix-caching", action="store_true", help="engines with prefix caching on (as served)")
    ap.add_argument("--extra-decode", nargs="*", default=[], metavar="B:P", type=batch_prompt,
                    help="more decode rows, after the others: batch B with prompts of P tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny-llama on the CPU (plumbing only; figures mean nothing); writes no file")
    ap.add_argument("--save-smoke", action="store_true", help="with --smoke: write the JSON too (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        save_smoke = args.save_smoke
        args = ap.parse_args([*SMOKE, "--out-dir", args.out_dir])
        args.smoke, args.save_smoke = True, save_smoke
    if not 0 < args.capacity <= 1 or args.every < 1 or args.new_tokens < 2:
        raise SystemExit("need 0 < --capacity <= 1, --every >= 1 and --new-tokens >= 2")
    if args.narrow_min_rows < 1 or args.narrow_bucket < 1:
        raise SystemExit("--narrow-min-rows and --narrow-bucket must be >= 1")
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)  # the samplers' global RNG (requests carry no seed)
    copy_bw = copy_bandwidth(device, args.copy_mib << 20, iters=10)
    graphs, thresholds = build_twins(args.spec, args.capacity, args.every, args.dtype, device, args.seed,
                                     (args.calib_prompts, args.calib_len), 2 if args.padded_prefill else 1)
    knobs = (args.narrow_min_rows, args.narrow_bucket)
    steps = [compile_side(*g, device, knobs) for g in graphs[:2]]
    steps += [compile_side(*g, device, (NEVER, args.narrow_bucket)) for g in graphs[2:]]
    dense, routed = {"cfg": graphs[0][0], "step": steps[0]}, {"cfg": graphs[1][0], "step": steps[1]}
    padded = {"cfg": graphs[1][0], "step": steps[2]} if args.padded_prefill else None
    del graphs
    cfg = dense["cfg"]
    layers = [i for i in range(cfg.layers) if routed["cfg"].route.routed(i)]
    bs = dense["step"].block_size
    weight_bytes = sum(p.numel() * p.element_size() for n, p in dense["step"].gm.named_parameters()
                       if "embed" not in n or cfg.tie_embeddings)  # a tied table is read as the lm_head
    name = Path(args.spec).name.removesuffix(".kiln")  # a bundled name, or a spec file's stem
    save = not args.smoke or args.save_smoke
    path = result_path(args.out_dir, f"mod_speed-{name}" + ("-smoke" if args.smoke else ""))
    result = {"bench": "mod_speed", **run_metadata(), "spec": args.spec, "smoke": args.smoke, "dtype": args.dtype,
              "capacity": args.capacity, "every": args.every, "decide": "threshold", "routed_layers": layers,
              "thresholds": thresholds, "temperature": args.temperature, "prefix_caching": args.prefix_caching,
              "eager": args.eager,
              "narrow_min_rows": args.narrow_min_rows, "narrow_bucket": args.narrow_bucket,
              "calibration": {"prompts": args.calib_prompts, "len": args.calib_len},
              "copy_bandwidth_gb_s": round(copy_bw / 1e9, 2), "weight_bytes": weight_bytes,
              "status": "partial: started", "rows": []}
    cuda_graphs = False if args.eager else None
    loads = [("prefill", Workload(args.prefill_prompts, args.prefill_len, 1, args.temperature,
                                  args.max_num_batched_tokens, args.prefix_caching, cuda_graphs))]
    loads += [(f"decode_{b}", Workload(b, args.decode_prompt, args.new_tokens, args.temperature,
                                       max(b * args.decode_prompt, 16), args.prefix_caching, cuda_graphs))
              for b in args.decode_batches]
    loads += [(f"decode_{b}_p{p}", Workload(b, p, args.new_tokens, args.temperature, max(b * p, 16),
                                            args.prefix_caching, cuda_graphs))
              for b, p in args.extra_decode]
    failed = False
    for load, w in loads:
        row = {"workload": load, "prompts": w.prompts, "prompt_len": w.prompt_len, "new_tokens": w.new_tokens}
        sides = [("dense", dense, w), ("routed", routed, w)]
        sides += [("routed_padded", padded, w)] if padded is not None and w.new_tokens == 1 else []
        # Decode: the dense twin again with async scheduling off: how much of its speed rests on hiding host work.
        sides += [("dense_sync", dense, dataclasses.replace(w, async_scheduling=False))] if w.new_tokens > 1 else []
        for side, m, wl in sides:
            try:  # a side that raises is its error, and the others still run (the GPU run must not lose them)
                row[side] = measure(m["step"], m["cfg"], wl, args.seed + 11 + len(result["rows"]), bs, layers)
            except Exception as e:
                row[side] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                say(f"{load} {side} FAILED: {row[side]['error']}")
                failed = True
            _free()  # the engine's pools go before the next one is sized
            if w.new_tokens > 1 and "error" not in row[side]:
                per_step = decode_bytes(m["step"].step, weight_bytes, w.prompts,
                                        w.prompt_len + w.new_tokens / 2, row[side]["kv_bytes_per_token"])
                row[side]["bytes_per_step"] = round(per_step)
                row[side]["bandwidth_share"] = float(f"{row[side]['tok_s'] / w.prompts * per_step / copy_bw:.4g}")
        ok = {side for side, *_ in sides if "error" not in row[side]}
        for side in ("routed", "routed_padded"):
            if {side, "dense"} <= ok:
                row[f"{side}_over_dense"] = round(row[side]["tok_s"] / row["dense"]["tok_s"], 3)
        if {"routed", "dense_sync"} <= ok:
            row["routed_over_dense_sync"] = round(row["routed"]["tok_s"] / row["dense_sync"]["tok_s"], 3)
        if w.new_tokens > 1 and {"routed", "dense"} <= ok:  # the most a memory-bound decode can gain: bytes a
            row["routed_over_dense_bytes_bound"] = round(row["dense"]["bytes_per_step"]  # step reads, dense / routed
                                                         / row["routed"]["bytes_per_step"], 3)
        target = TARGETS.get(load.split("_p")[0])  # the batch-64 decode target holds at any prompt length
        if target is not None:
            row["target"] = target
        if {"routed", "dense"} <= ok:
            say(f"{load}: dense {row['dense']['tok_s']:.1f} tok/s, routed {row['routed']['tok_s']:.1f} tok/s, "
                f"{row['routed_over_dense']:.2f}x{f' (target {target}x)' if target is not None else ''}"
                + (f", routed without narrowing {row['routed_padded_over_dense']:.2f}x"
                   if "routed_padded_over_dense" in row else "")
                + (f", over dense without async scheduling {row['routed_over_dense_sync']:.2f}x"
                   if "routed_over_dense_sync" in row else "")
                + f"; routed fraction per layer {row['routed']['routed_fraction']}")
        result["rows"].append(row)
        result["status"] = f"partial: {len(result['rows'])} of {len(loads)} workloads"
        if save:
            write_json(path, result)  # after every workload: a run cut short keeps what it measured
    result["status"] = "complete"
    if save:
        write_json(path, result)
    say(f"wrote {path}" if save else "smoke: no file written (--save-smoke writes it)")
    if failed:
        say("FAILED: some workloads' sides raised (their error is in the JSON)")
    return result


if __name__ == "__main__":
    rows = main()["rows"]
    sys.exit(1 if any("error" in side for r in rows for side in r.values() if isinstance(side, dict)) else 0)
