"""Batch-1 decode throughput with quantized weights: bf16 vs int8 vs int4 on a 1B-class spec, in one run.

A decode step here is the compiled graph (generated kernels, quantized linears through quant_gemv) on one
token at position 0, replayed as a CUDA graph so launch overhead does not hide the weight reads. Every weight
but the embedding table is read once per step, which is what bounds batch-1 decode; the KV-cache reads of a
long context are left out. Reported per scheme: step time, tokens/s, weight bytes read per step, achieved
GB/s, that as a share of the device's copy bandwidth measured in the same run, and the speed-up over bf16.
Weights are seeded random (speed does not depend on their values); quantization is RTN.

Needs CUDA: without it this says so and exits 2, with no figures.

    python bench/quant.py [--spec llama-3.2-1b] [--schemes bf16,int8,int4-g128] [--iters 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import torch


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy GB/s (read + write): the practical ceiling for streaming weights."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def bytes_read_per_step(gm: torch.fx.GraphModule) -> int:
    """Weight bytes a one-token step reads: every tensor, except tables only gathered from (embeddings)."""
    gathers = {torch.ops.kiln.embedding.default, torch.ops.kiln.embedding_q.default}
    skip = {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and n.users and all(u.op == "call_function" and u.target in gathers for u in n.users)
    }
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name not in skip)


def time_step(fn, iters: int) -> tuple[float, bool]:
    """Mean seconds per call of fn(), replayed as a CUDA graph when capture works (else called eagerly)."""
    side = torch.cuda.Stream()  # warm up (kernel loads, allocator) on a side stream, as capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run, captured = graph.replay, True
    except Exception as e:  # a kernel that cannot be captured: measure eagerly and say so
        print(f"bench: CUDA graph capture failed ({type(e).__name__}: {e}); timing eager calls", file=sys.stderr)
        run, captured = fn, False
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, captured


def measure(spec: str, scheme: str, iters: int) -> dict:
    from kiln.compile.driver import compile_model
    from kiln.compile.pipeline import quantize_graph
    from kiln.ir.frontend import build_graph
    from kiln.model_config import CompileConfig
    from kiln.spec.loader import load_spec

    cfg = load_spec(spec).model
    gm = build_graph(cfg, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    if scheme != "bf16":
        gm = quantize_graph(gm, scheme)
    quantize_s = time.perf_counter() - t0
    nbytes = bytes_read_per_step(gm)
    compiled = compile_model(gm, CompileConfig(dtype="bf16"), use_kernels=True)
    tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    positions = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        step_s, captured = time_step(partial(compiled, tokens, positions), iters)
    del compiled, gm
    torch.cuda.empty_cache()
    return {"scheme": scheme, "step_ms": step_s * 1e3, "tokens_per_s": 1 / step_s, "bytes_per_step": nbytes,
            "gb_per_s": nbytes / step_s / 1e9, "cuda_graph": captured, "quantize_s": quantize_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="llama-3.2-1b")
    p.add_argument("--schemes", default="bf16,int8,int4-g128")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/quant.py needs a CUDA device (decode throughput is a GPU measurement); none found, "
              "so no figures are reported", file=sys.stderr)  # fmt: skip
        return 2
    ceiling = copy_bandwidth()
    rows = [measure(args.spec, s, args.iters) for s in args.schemes.split(",")]
    base = next((r for r in rows if r["scheme"] == "bf16"), rows[0])
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling:.0f} GB/s; {args.spec}, batch 1, one token")
    print(f"{'scheme':<14}{'step ms':>9}{'tok/s':>9}{'GB/step':>9}{'GB/s':>8}{'% copy':>8}{'vs ' + base['scheme']:>9}")
    for r in rows:
        r["pct_of_copy_bw"] = 100 * r["gb_per_s"] / ceiling
        r["speedup"] = base["step_ms"] / r["step_ms"]
        print(f"{r['scheme']:<14}{r['step_ms']:>9.3f}{r['tokens_per_s']:>9.0f}{r['bytes_per_step'] / 1e9:>9.3f}"
              f"{r['gb_per_s']:>8.0f}{r['pct_of_copy_bw']:>7.0f}%{r['speedup']:>8.2f}x"
              + ("" if r["cuda_graph"] else "  (eager)"))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gb_per_s": ceiling, "spec": args.spec,
                       "rows": rows}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
