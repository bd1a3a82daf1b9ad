"""Paged decode attention: kiln's split-KV decode kernel vs SDPA over the same keys gathered contiguously.

One new query per sequence over a paged KV cache (block 16, blocks shuffled as a running server leaves them),
GQA 32/8, head dims 64 and 128, bf16, batch 1 / 16 / 64 / 256, every sequence at the same context of 512 to
32k keys. kiln runs kiln.codegen.paged.paged_attention_decode as the runtime does (split count from the
batch's context length and the SM count, then the merge kernel); the baseline is torch SDPA (enable_gqa) on
the K/V gathered into contiguous [B, Hkv, ctx, D] tensors outside the timed region. Reports both times, and
the K/V bytes each reads per call over its time as a share of the copy bandwidth (dst.copy_(src): bytes read
+ written) measured in the same run. Issue 10's target: kiln at least 70% of copy bandwidth at batch 64,
context 4096. Points whose cache would exceed --max-tokens (batch x context) are skipped and listed. Needs
CUDA; writes bench/results/decode_attention-<device>-<date>.json, rewritten after every row (a run cut off keeps
what it measured). A row whose output differs from SDPA (or that raises) is recorded as {"batch", "context",
"head_dim", "error"}, a head dim whose tuning raises as {"head_dim", "error"} (in "errors" and as its entry in
tiles_by_head_dim; its points are not measured), the run goes on, and it exits 1 at the end.

    python bench/decode_attention.py [--batches 1,16,64,256] [--contexts 512,...,32768] [--head-dims 64,128]
                                     [--dtype bf16] [--max-tokens 2097152] [--out bench/results]
    python bench/decode_attention.py --smoke    # CPU, Triton's interpreter, tiny shapes: correctness only
                                                # (--save-smoke: the file too, as the GPU run writes it)
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from attention import DTYPES, _ints, run_on_device
from bench_meta import result_path, run_metadata, write_json
from ceilings import copy_bandwidth


def paged_problem(batch: int, ctx: int, cfg: dict, device: str, seed: int):
    """q [B, H * D], a one-layer paged cache of shuffled blocks holding each sequence's ctx keys, and the step
    inputs (block tables, context lengths, query start offsets)."""
    h, hkv, d, bs, dtype = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"], DTYPES[cfg["dtype"]]
    per_seq = -(-ctx // bs)
    num_blocks = batch * per_seq + 1
    g = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(1, 2, num_blocks, bs, hkv, d, device=device, dtype=dtype, generator=g)
    pool = torch.randperm(num_blocks, device=device, generator=g)[: batch * per_seq]
    tables = pool.view(batch, per_seq).to(torch.int32).contiguous()
    q = torch.randn(batch, h * d, device=device, dtype=dtype, generator=g)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, cache, tables, context_lens, query_start_loc


def gathered(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values as contiguous [B, Hkv, ctx, D] tensors."""
    b = tables.shape[0]
    k, v = (cache[0, i][tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous() for i in (0, 1))
    assert k.shape[0] == b
    return k, v


def tune(cfg: dict, batch: int, ctx: int, device: str):
    """The decode tile for cfg, tuned at (batch, ctx) on this device (or loaded from the tuning cache)."""
    from kiln.codegen.paged import paged_attention_decode
    from kiln.codegen.paged_tiles import tune_decode

    h, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, cache, tables, context_lens, qsl = paged_problem(batch, ctx, cfg, device, seed=1)
    out = torch.empty_like(q)

    def make_call(tile):
        return partial(paged_attention_decode, q, cache, 0, tables, context_lens, qsl, ctx, h, 0, d**-0.5, out=out,
                       tile=tile)  # fmt: skip

    return tune_decode(torch.device(device), q.dtype, cache.dtype, d, h // hkv, make_call)


def measure(cfg: dict, batch: int, ctx: int, tile, time_ms, copy_bw: float, device: str) -> dict:
    from kiln.codegen.paged import paged_attention_decode
    from kiln.codegen.paged_tiles import decode_splits

    h, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, cache, tables, context_lens, qsl = paged_problem(batch, ctx, cfg, device, seed=batch * 7919 + ctx + d)
    out = torch.empty_like(q)
    kiln = partial(paged_attention_decode, q, cache, 0, tables, context_lens, qsl, ctx, h, 0, d**-0.5, out=out,
                   tile=tile)  # fmt: skip
    k, v = gathered(cache, tables, ctx)
    q4 = q.view(batch, h, 1, d)
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q4, k, v, enable_gqa=True)
    ref = sdpa().reshape(batch, h * d).float()
    err = (kiln().float() - ref).abs().max().item()
    if not err <= 2e-2 * max(ref.abs().max().item(), 1.0):
        # recorded for this row by _run (exit 1 at the end), not timed
        return {"batch": batch, "context": ctx, "head_dim": d, "error": f"mismatch {err}"}
    t_kiln, t_sdpa = time_ms(kiln), time_ms(sdpa)
    kv_bytes = 2 * batch * ctx * hkv * d * q.element_size()
    return {
        "batch": batch, "context": ctx, "head_dim": d, "kiln_ms": t_kiln, "sdpa_ms": t_sdpa,
        "kiln_vs_sdpa": t_sdpa / t_kiln, "kv_bytes": kv_bytes,
        "kiln_gb_s": kv_bytes / (t_kiln * 1e-3) / 1e9, "sdpa_gb_s": kv_bytes / (t_sdpa * 1e-3) / 1e9,
        "kiln_of_copy_bw": kv_bytes / (t_kiln * 1e-3) / copy_bw,
        "sdpa_of_copy_bw": kv_bytes / (t_sdpa * 1e-3) / copy_bw,
        "num_splits": decode_splits(batch, hkv, ctx, 0, tile.block_n, q.device), "max_abs_err": err,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192,16384,32768")
    p.add_argument("--head-dims", default=None, help="default 64,128 (--smoke: 64)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--max-tokens", type=int, default=2 << 20, help="skip points with batch x context above this")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--no-tune", action="store_true", help="the default (or previously tuned) decode tile")
    p.add_argument("--out-dir", "--out", dest="out", default="bench/results", help="where the JSON goes")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, Triton's interpreter, tiny shapes: checks kiln against SDPA, writes nothing")
    p.add_argument("--save-smoke", action="store_true", help="with --smoke: write the JSON too (for tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts, args.heads, args.kv_heads = "1,3", "40,77", 4, 2
        args.dtype, args.copy_mib = "fp32", 8
    args.head_dims = args.head_dims or ("64" if args.smoke else "64,128")  # a smoke run may name its own (tests)
    return run_on_device(args.smoke, "bench/decode_attention.py", lambda device, time_ms: _run(args, device, time_ms))


def _run(args: argparse.Namespace, device: str, time_ms) -> int:
    from kiln.codegen.paged_tiles import decode_tile

    copy_bw = copy_bandwidth(device, args.copy_mib << 20)
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows, skipped, tiles, tune_errors = [], [], {}, []
    save, path, meta = not args.smoke or args.save_smoke, result_path(args.out, "decode_attention"), run_metadata()
    tune_at = (3, 77) if args.smoke else (64, 4096)  # the target point
    for d in _ints(args.head_dims):
        cfg = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": d, "block_size": args.block_size,
               "dtype": args.dtype}  # fmt: skip
        if args.no_tune:
            dtype = DTYPES[args.dtype]
            tile = decode_tile(torch.device(device), dtype, dtype, d, args.heads // args.kv_heads)
        else:
            try:
                tile = tune(cfg, *tune_at, device)
            except Exception as e:  # recorded (exit 1 at the end); the next head dim may still run
                # Its points are skipped, not run on the default tile: when every candidate failed, that one
                # fails too, and a compile error paid again at each point could use up the command's time limit.
                error = {"head_dim": d, "error": f"tune: {type(e).__name__}: {e}"[:500]}
                tiles[d] = {"error": error["error"]}  # collect.py reports it from here
                tune_errors.append(error)
                print(f"d{d}: FAILED {error['error']}; its points are skipped", file=sys.stderr, flush=True)
                if save:
                    write_json(path, _result(args, meta, tiles, tune_at, rows, skipped, copy_bw, tune_errors))
                continue
        tiles[d] = tile.__dict__
        print(f"d{d}: decode tile {tile}", flush=True)
        for batch in _ints(args.batches):
            for ctx in _ints(args.contexts):
                if batch * ctx > args.max_tokens:
                    skipped.append({"batch": batch, "context": ctx, "head_dim": d})
                    continue
                try:
                    row = measure(cfg, batch, ctx, tile, time_ms, copy_bw, device)
                except Exception as e:  # recorded (exit 1 at the end): the other points may still run
                    row = {"batch": batch, "context": ctx, "head_dim": d, "error": f"{type(e).__name__}: {e}"[:500]}
                rows.append(row)
                if save:  # after every row: a timeout or a crash later keeps what was measured
                    write_json(path, _result(args, meta, tiles, tune_at, rows, skipped, copy_bw, tune_errors))
                if "error" in row:
                    print(f"d{d} batch {batch:3d} ctx {ctx:5d}: FAILED {row['error']}", file=sys.stderr, flush=True)
                    continue
                print(f"d{d} batch {batch:3d} ctx {ctx:5d}: kiln {row['kiln_ms'] * 1e3:8.1f} us "
                      f"({row['kiln_of_copy_bw']:.0%} of copy BW, {row['num_splits']} splits)  sdpa "
                      f"{row['sdpa_ms'] * 1e3:8.1f} us ({row['sdpa_of_copy_bw']:.0%})  {row['kiln_vs_sdpa']:.2f}x",
                      flush=True)  # fmt: skip
                if device == "cuda":
                    torch.cuda.empty_cache()
    result = _result(args, meta, tiles, tune_at, rows, skipped, copy_bw, tune_errors)
    failed = [r for r in rows if "error" in r]
    if args.smoke:
        print(f"smoke: {len(rows) - len(failed)} rows equal SDPA ({len(skipped)} skipped); {result['autotune']}; "
              + (f"wrote {path}" if save else "no figure written"))
    else:
        print(f"wrote {path}")
    if failed:
        print(f"FAILED: {len(failed)} of {len(rows)} rows (their error is in the JSON)", file=sys.stderr)
    if tune_errors:
        print(f"FAILED: tuning for head dim {', '.join(str(e['head_dim']) for e in tune_errors)} (its points were "
              "not measured; the error is in the JSON)", file=sys.stderr)
    return 1 if failed or tune_errors else 0


def _result(args: argparse.Namespace, meta: dict, tiles: dict, tune_at: tuple[int, int], rows: list[dict],
            skipped: list[dict], copy_bw: float, tune_errors: list[dict]) -> dict:
    from kiln.codegen import autotune

    # The target point in every head dim measured: a head dim whose row failed, or whose tuning failed (no rows),
    # does not meet it; None when the run measured the point in no head dim at all.
    at = {d: [r for r in rows if (r["batch"], r["context"], r["head_dim"]) == (64, 4096, d)]
          for d in _ints(args.head_dims)}
    met = None if not any(at.values()) else all(
        rs and all("error" not in r and r["kiln_of_copy_bw"] >= 0.7 for r in rs) for rs in at.values())
    return {
        **meta,
        "benchmark": "decode_attention",
        "config": {"heads": args.heads, "kv_heads": args.kv_heads, "block_size": args.block_size,
                   "dtype": args.dtype, "sdpa": "enable_gqa over K/V gathered contiguously",
                   "tiles_by_head_dim": tiles, "tuned_at": {"batch": tune_at[0], "context": tune_at[1]}},
        "autotune": autotune.stats().summary(),  # fmt: skip
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "rows": rows,
        "skipped_over_max_tokens": skipped,
        "target": "kiln_of_copy_bw >= 0.7 at batch 64, context 4096",
        "target_met": met,
        "errors": [r for r in rows if "error" in r] + tune_errors,  # a failed tune: {"head_dim", "error"}
    }


if __name__ == "__main__":
    sys.exit(main())
