"""Quantized linears: per-shape kernel times and the whole decode step, bf16 vs int8 vs int4-g128, in one run.

Per shape: every linear of the specs (default llama-3.2-1b and llama-3.1-8b: fused qkv, o, fused gate_up, down,
lm_head) at M = 1, 16, 32, 64 activation rows, with seeded random weights (RTN): torch.nn.functional.linear on the
bf16 weight (cuBLAS) against kiln's int8 (per channel) and int4 (group 128, symmetric) kernels, each checked
against dequantize-then-matmul first. The calls of one measurement cycle through enough copies of the weight
to exceed the L2 cache three times over (so every call reads its weight from DRAM, as in a step) and are
replayed as one CUDA graph (launch gaps as in a step); the figure is the median of 7 replays. Reported: us per
call, bytes read (weights, activations, output), GB/s, share of the copy bandwidth measured in the same run,
speed-up over bf16, and the kernel / tile / split-K the wrapper chose.

Step (bench/quant_step.py): the llama-3.2-1b batch-1 step per scheme under a CUDA graph, as a share of copy
bandwidth, and for each scheme the launches per step and the ops outside GEMMs and attention (not fused).

--sweep (a run of its own, quant-sweep-*.json): times candidate tiles for every shape at M = 1 and 16 (int8 and
int4) and prints the fastest as codegen/quant_tiles.py MEASURED entries, with their times.
--smoke: the CPU check of all of the above (Triton interpreter, tiny shapes, every result checked against the
reference, the tiny-llama step's launch profile); it times nothing and writes no figure. Without CUDA and
without --smoke this says so and exits 2.

    python bench/quant.py [--specs llama-3.2-1b,llama-3.1-8b] [--m 1,16,32,64] [--step-spec llama-3.2-1b]
                          [--iters 200] [--sweep] [--out-dir bench/results] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_meta, quant_step when run as a script
from quant_step import compiled_step, launch_profile, measure_step  # noqa: E402

SCHEMES = ("bf16", "int8", "int4-g128")
SWEEP = {  # candidate (kernel, block_m, block_n, block_k, split_k, num_warps, num_stages) per M class
    "gemv": [(bn, bk, s, w) for bn, bk, w in ((2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 8),
                                               (4, 4096, 8)) for s in (1, 2)],
    "gemm": [(bn, bk, s) for bn in (32, 64, 128) for bk in (64, 128) for s in (1, 2, 4, 8)],
}  # fmt: skip


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy GB/s (read + write): the practical ceiling for streaming weights."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")  # never time on all-zero inputs
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


def linear_shapes(spec: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear of a spec's layer (qkv and gate_up fused, as kiln runs them) and the lm_head."""
    from kiln.spec.loader import load_spec

    c = load_spec(spec).model
    q = c.heads * c.head_dim
    return [("qkv", q + 2 * c.kv_heads * c.head_dim, c.dim), ("o", c.dim, q), ("gate_up", 2 * c.ffn, c.dim),
            ("down", c.dim, c.ffn), ("lm_head", c.vocab, c.dim)]  # fmt: skip


class Linear:
    """One weight in one scheme on a device, with `copies` clones so timed calls do not hit L2."""

    def __init__(self, n: int, k: int, scheme: str, device: str, dtype: torch.dtype, copies: int = 1, seed: int = 0):
        from kiln.quant.formats import dequantize, parse_scheme, quantize_rtn

        g = torch.Generator(device=device).manual_seed(seed)
        w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        self.scheme, self.n, self.k = scheme, n, k
        if scheme == "bf16":
            parts = [(w,)]
            self.reference = w
        else:
            qw = quantize_rtn(w, parse_scheme(scheme))
            parts = [(qw.qweight, qw.scales, qw.zeros, qw.group)]
            self.reference = dequantize(qw, dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in parts[0] if isinstance(t, torch.Tensor))
        for _ in range(copies - 1):
            parts.append(tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in parts[0]))
        self.parts = parts

    def call(self, i: int, x: torch.Tensor, out: torch.Tensor, tile=None) -> torch.Tensor:
        from kiln.codegen.quant import linear_w4, linear_w8

        p = self.parts[i % len(self.parts)]
        if self.scheme == "bf16":
            return torch.nn.functional.linear(x, p[0])
        if self.scheme == "int8":
            return linear_w8(x, p[0], p[1], out=out, tile=tile)
        return linear_w4(x, p[0], p[1], p[2], p[3], out=out, tile=tile)

    def check(self, x: torch.Tensor, tile=None) -> float:
        """Max |kernel - dequantize-then-matmul| relative to the reference's largest entry."""
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)
        got = self.call(0, x, out, tile).float()
        want = x.float() @ self.reference.float().T
        return ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()


def chosen_tile(lin: Linear, m: int, device: str) -> dict | None:
    from kiln.codegen.quant import device_info
    from kiln.codegen.quant_tiles import choose_tile

    if lin.scheme == "bf16":
        return None
    sms, cap = device_info(torch.device(device))
    bits, group = (8, 0) if lin.scheme == "int8" else (4, 128)
    return asdict(choose_tile(bits, group, m, lin.n, lin.k, sm_count=sms, capability=cap))


def time_calls(fns, repeats: int = 7, replays: int = 5) -> float:
    """Median seconds per call of the fns, captured back to back in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays / len(fns))
    return statistics.median(times)


def time_linear(lin: Linear, x: torch.Tensor, out: torch.Tensor, tile=None) -> float:
    """Seconds per call of lin on x, each call reading another copy of the weight (at least 4 calls)."""
    return time_calls([partial(lin.call, i, x, out, tile) for i in range(max(len(lin.parts), 4))])


def copies_for(nbytes: int, device: str) -> int:
    """Weight copies one measurement cycles through: their bytes exceed the L2 cache three times (1 off CUDA)."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(64, -(-3 * l2 // nbytes)))


def all_shapes(specs: list[str]) -> list[tuple[str, str, int, int]]:
    return [(spec, name, n, k) for spec in specs for name, n, k in linear_shapes(spec)]


def measure_shapes(shapes, ms: list[int], ceiling: float, device: str = "cuda", dtype=torch.bfloat16) -> list[dict]:
    """One row per (shape, scheme, M): time, bytes, GB/s, share of copy bandwidth, speed-up, error, tile."""
    rows = []
    for spec, name, n, k in shapes:
        base = {}
        for scheme in SCHEMES:
            probe = Linear(n, k, scheme, device, dtype)
            lin = Linear(n, k, scheme, device, dtype, copies=copies_for(probe.nbytes, device))
            del probe
            x_all = torch.randn(max(ms), k, device=device, dtype=dtype)
            for m in ms:
                x, out = x_all[:m], torch.empty(m, n, device=device, dtype=dtype)
                err = lin.check(x)
                sec = time_linear(lin, x, out)
                nbytes = lin.nbytes + x.element_size() * m * (k + n)
                if scheme == "bf16":
                    base[m] = sec
                rows.append({"spec": spec, "linear": name, "n": n, "k": k, "m": m, "scheme": scheme, "us": sec * 1e6,
                             "bytes": nbytes, "gb_per_s": nbytes / sec / 1e9,
                             "pct_of_copy_bw": 100 * nbytes / sec / 1e9 / ceiling,
                             "speedup_vs_bf16": base[m] / sec if m in base else None, "max_rel_err": err,
                             "tile": chosen_tile(lin, m, device), "weight_copies": len(lin.parts)})  # fmt: skip
                r = rows[-1]
                print(f"{spec:<13}{name:<8}{n:>7}{k:>6}{m:>4} {scheme:<10}{r['us']:>9.2f} us{r['gb_per_s']:>7.0f} GB/s"
                      f"{r['pct_of_copy_bw']:>5.0f}%{r['speedup_vs_bf16'] or 0:>6.2f}x  err {err:.1e}")  # fmt: skip
            del lin
            torch.cuda.empty_cache()
    return rows


def sweep_one(lin: Linear, m: int, ceiling: float) -> tuple[float, object, int, float] | None:
    """(seconds, tile, candidates timed, share of copy bandwidth) of the fastest correct candidate tile at M = m."""
    from kiln.codegen.quant_tiles import QuantTile

    ref = lin.reference
    x = torch.randn(m, lin.k, device=ref.device, dtype=ref.dtype)
    out = torch.empty(m, lin.n, device=ref.device, dtype=ref.dtype)
    if m == 1:
        tiles = [QuantTile("quant_gemv", 1, bn, bk, s, w) for bn, bk, s, w in SWEEP["gemv"]]
    else:
        tiles = [QuantTile("quant_gemm", 16, bn, bk, s, 4, 3) for bn, bk, s in SWEEP["gemm"]]
    timed = []
    for t in tiles:
        try:  # a candidate may not fit this GPU (shared memory, registers): skip it
            if t.block_k <= max(lin.k, 64) and lin.check(x, t) < 2e-2:
                timed.append((time_linear(lin, x, out, t), t))
        except Exception as e:  # triton's OutOfResources and compile errors have no common KilnError base
            print(f"    skipped {t}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
    if not timed:
        return None
    sec, best = min(timed, key=lambda v: v[0])
    return sec, best, len(timed), 100 * (lin.nbytes + x.element_size() * m * (lin.n + lin.k)) / sec / 1e9 / ceiling


def sweep(shapes, ceiling: float, device: str = "cuda", dtype=torch.bfloat16) -> list[dict]:
    """The fastest candidate tile per (scheme, shape, M in 1 and 16), as codegen/quant_tiles.py MEASURED keys."""
    from kiln.codegen.quant import device_info

    _, cap = device_info(torch.device(device))
    winners = []
    for (spec, name, n, k), scheme in itertools.product(shapes, SCHEMES[1:]):
        probe = Linear(n, k, scheme, device, dtype)
        lin = Linear(n, k, scheme, device, dtype, copies=copies_for(probe.nbytes, device))
        del probe
        for m in (1, 16):
            found = sweep_one(lin, m, ceiling)
            if found is None:
                print(f"    no candidate tile fits {spec} {name} {scheme} M={m}", file=sys.stderr)
                continue
            sec, best, count, pct = found
            bits, group = (8, 0) if scheme == "int8" else (4, 128)
            key = (cap, best.kernel, bits, group, m if m == 1 else 16, n, k)
            winners.append({"key": repr(key), "tile": repr(best), "us": sec * 1e6, "linear": f"{spec} {name}",
                            "candidates": count, "pct_of_copy_bw": pct})  # fmt: skip
            print(f"    {key!r}: {best!r},  # {spec} {name}: {sec * 1e6:.2f} us, {pct:.0f}% of copy BW")
        del lin
        torch.cuda.empty_cache()
    return winners


def smoke() -> int:
    """CPU plumbing check (interpreter): tiny shapes through every kernel path, checked; the tiny step's launches."""
    from kiln.codegen.quant_tiles import QuantTile

    failures = []
    for n, k in ((72, 256), (40, 384)):
        x = torch.randn(33, k)
        for scheme in SCHEMES:
            lin = Linear(n, k, scheme, "cpu", torch.float32)
            tiles = [None, QuantTile("quant_gemv", 1, 8, 128, 2), QuantTile("quant_gemm", 16, 16, 64, 3)]
            for m, tile in ((1, None), (3, tiles[1]), (17, None), (33, tiles[2])):
                err = lin.check(x[:m], tile if scheme != "bf16" else None)
                if not err < 1e-4:
                    failures.append(f"{scheme} N={n} K={k} M={m} tile={tile}: relative error {err:.2e}")
    for scheme in SCHEMES:
        compiled, inputs, _ = compiled_step("tiny-llama", scheme.replace("g128", "g32"), "cpu", torch.float32)
        profile = launch_profile(compiled.gm, inputs)
        print(f"tiny-llama {scheme} step: {profile['launches_per_step']} launches; not fused: {profile['not_fused']}")
        if profile["launches_per_step"] <= 0 or not profile["ops"]:
            failures.append(f"{scheme}: empty launch profile")
        compiled(*inputs)
    for f in failures:
        print("smoke FAILED:", f, file=sys.stderr)
    print("bench/quant.py --smoke: " + ("ok" if not failures else f"{len(failures)} failures") + " (no figures)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    from bench_meta import result_path, run_metadata, write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--m", default="1,16,32,64", help="activation rows per call")
    p.add_argument("--step-spec", default="llama-3.2-1b")
    p.add_argument("--iters", type=int, default=200, help="step replays timed")
    p.add_argument("--sweep", action="store_true", help="instead: time candidate tiles, print MEASURED entries")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--smoke", action="store_true", help="CPU check under the Triton interpreter; no figures")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("bench/quant.py needs a CUDA device (kernel times are a GPU measurement); none found, so no figures "
              "are reported (--smoke checks the plumbing on CPU)", file=sys.stderr)  # fmt: skip
        return 2
    ceiling = copy_bandwidth()
    specs, ms = args.specs.split(","), [int(m) for m in args.m.split(",")]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling:.0f} GB/s")
    if args.sweep:  # a run of its own (it compiles and times ~12-24 tiles per shape)
        winners = sweep(all_shapes(specs), ceiling)
        result = {"benchmark": "quant-sweep", **run_metadata(), "copy_gb_per_s": ceiling, "sweep": winners}
        print(f"wrote {write_json(result_path(args.out_dir, 'quant-sweep'), result)}")
        return 0
    shapes = measure_shapes(all_shapes(specs), ms, ceiling)
    steps = [measure_step(args.step_spec, s, args.iters, ceiling) for s in SCHEMES]
    base = steps[0]["step_ms"]
    for r in steps:
        r["speedup_vs_bf16"] = base / r["step_ms"]
        lp = r["launches"]
        print(f"step {args.step_spec} {r['scheme']:<10}{r['step_ms']:>8.3f} ms{r['pct_of_copy_bw']:>5.0f}% of copy BW "
              f"{r['speedup_vs_bf16']:.2f}x; {lp['launches_per_step']} launches (profiler: "
              f"{lp['profiled_kernels_per_step']}); not fused: {', '.join(lp['not_fused'])}")  # fmt: skip
    result = {"benchmark": "quant", **run_metadata(), "copy_gb_per_s": ceiling, "shapes": shapes,
              "step": {"spec": args.step_spec, "batch": 1, "rows": steps}}  # fmt: skip
    path = write_json(result_path(args.out_dir, "quant"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
