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
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_meta, quant_step when run as a script
from ceilings import copy_bandwidth  # noqa: E402
from quant_linear import Linear, copies_for, time_linear  # noqa: E402
from quant_step import compiled_step, launch_profile, measure_step  # noqa: E402

SCHEMES = ("bf16", "int8", "int4-g128")
SWEEP = {  # candidate (kernel, block_m, block_n, block_k, split_k, num_warps, num_stages) per M class
    "gemv": [(bn, bk, s, w) for bn, bk, w in ((2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 8),
                                               (4, 4096, 8)) for s in (1, 2)],
    "gemm": [(bn, bk, s) for bn in (32, 64, 128) for bk in (64, 128) for s in (1, 2, 4, 8)],
}  # fmt: skip


def linear_shapes(spec: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear of a spec's layer (qkv and gate_up fused, as kiln runs them) and the lm_head."""
    from kiln.spec.loader import load_spec

    c = load_spec(spec).model
    q = c.heads * c.head_dim
    return [("qkv", q + 2 * c.kv_heads * c.head_dim, c.dim), ("o", c.dim, q), ("gate_up", 2 * c.ffn, c.dim),
            ("down", c.dim, c.ffn), ("lm_head", c.vocab, c.dim)]  # fmt: skip


def chosen_tile(lin: Linear, m: int, device: str) -> dict | None:
    from kiln.codegen.quant import device_info
    from kiln.codegen.quant_tiles import choose_tile

    if lin.scheme == "bf16":
        return None
    sms, cap = device_info(torch.device(device))
    bits, group = (8, 0) if lin.scheme == "int8" else (4, 128)
    return asdict(choose_tile(bits, group, m, lin.n, lin.k, sm_count=sms, capability=cap))


def all_shapes(specs: list[str]) -> list[tuple[str, str, int, int]]:
    return [(spec, name, n, k) for spec in specs for name, n, k in linear_shapes(spec)]


def measure_shapes(shapes, ms: list[int], ceiling: float, device: str = "cuda", dtype=torch.bfloat16,
                   on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One row per (shape, scheme, M): time, bytes, GB/s, share of copy bandwidth, speed-up, error, tile. A (shape,
    scheme) that raises is one row with its `error`, and the next still runs; on_row(rows) after every row (the
    caller writes the file: a run cut short by its time limit keeps what it measured)."""
    rows: list[dict] = []
    for spec, name, n, k in shapes:
        base: dict[int, float] = {}
        for scheme in SCHEMES:
            try:
                for row in _scheme_rows(spec, name, n, k, scheme, ms, ceiling, device, dtype, base):
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
            except Exception as e:
                rows.append({"spec": spec, "linear": name, "n": n, "k": k, "scheme": scheme,
                             "error": f"{type(e).__name__}: {e}"[:1000]})
                print(f"bench: {spec} {name} {scheme} failed: {rows[-1]['error']}", file=sys.stderr)
                if on_row is not None:
                    on_row(rows)
            torch.cuda.empty_cache()
    return rows


def _scheme_rows(spec: str, name: str, n: int, k: int, scheme: str, ms: list[int], ceiling: float, device: str,
                 dtype, base: dict[int, float]) -> Iterator[dict]:
    """measure_shapes' rows of one (shape, scheme), one per M; base: bf16's seconds per M (filled by bf16, first)."""
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
        r = {"spec": spec, "linear": name, "n": n, "k": k, "m": m, "scheme": scheme, "us": sec * 1e6,
             "bytes": nbytes, "gb_per_s": nbytes / sec / 1e9, "pct_of_copy_bw": 100 * nbytes / sec / 1e9 / ceiling,
             "speedup_vs_bf16": base[m] / sec if m in base else None, "max_rel_err": err,
             "tile": chosen_tile(lin, m, device), "weight_copies": len(lin.parts)}  # fmt: skip
        print(f"{spec:<13}{name:<8}{n:>7}{k:>6}{m:>4} {scheme:<10}{r['us']:>9.2f} us{r['gb_per_s']:>7.0f} GB/s"
              f"{r['pct_of_copy_bw']:>5.0f}%{r['speedup_vs_bf16'] or 0:>6.2f}x  err {err:.1e}")  # fmt: skip
        yield r


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
    ceiling = copy_bandwidth("cuda") / 1e9  # GB/s
    specs, ms = args.specs.split(","), [int(m) for m in args.m.split(",")]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling:.0f} GB/s")
    if args.sweep:  # a run of its own (it compiles and times ~12-24 tiles per shape)
        winners = sweep(all_shapes(specs), ceiling)
        result = {"benchmark": "quant-sweep", **run_metadata(), "copy_gb_per_s": ceiling, "sweep": winners}
        print(f"wrote {write_json(result_path(args.out_dir, 'quant-sweep'), result)}")
        return 0
    path = result_path(args.out_dir, "quant")
    result = {"benchmark": "quant", **run_metadata(), "copy_gb_per_s": ceiling, "status": "partial: shapes",
              "shapes": [], "step": {"spec": args.step_spec, "batch": 1}}

    def save_shapes(rows: list[dict]) -> None:  # after every row: a run cut short keeps what it measured
        result["shapes"] = rows
        write_json(path, result)

    measure_shapes(all_shapes(specs), ms, ceiling, on_row=save_shapes)
    result["status"] = "partial: the whole step"
    write_json(path, result)  # written now: the step part must not lose it
    steps = []
    for scheme in SCHEMES:
        try:
            steps.append(measure_step(args.step_spec, scheme, args.iters, ceiling))
        except Exception as e:  # reported in the JSON; the figures measured so far are kept
            print(f"bench: {scheme} step failed: {type(e).__name__}: {e}", file=sys.stderr)
            steps.append({"scheme": scheme, "error": f"{type(e).__name__}: {e}"})
    base = steps[0].get("step_ms")
    for r in steps:
        if "error" in r:
            continue
        r["speedup_vs_bf16"] = base / r["step_ms"] if base else None
        lp = r["launches"]
        print(f"step {args.step_spec} {r['scheme']:<10}{r['step_ms']:>8.3f} ms{r['pct_of_copy_bw']:>5.0f}% of copy BW "
              f"{r['speedup_vs_bf16'] or 0:.2f}x; {lp['launches_per_step']} launches (profiler: "
              f"{lp['profiled_kernels_per_step']}); not fused: {', '.join(lp['not_fused'])}")  # fmt: skip
    result["step"]["rows"] = steps
    result["status"] = "complete"
    write_json(path, result)
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in steps + result["shapes"]) else 1

if __name__ == "__main__":
    sys.exit(main())
