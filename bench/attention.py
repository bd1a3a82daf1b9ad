"""Flash prefill: kiln's generated kernel vs torch's scaled_dot_product_attention, measured in one run.

Causal attention, batch 4, 32 heads, head dim 128, bf16, seq 1024..8192. Reports TFLOP/s of both, the ratio,
and both against the device's measured dense bf16 matmul ceiling (taken in the same run). Target: kiln at
least 0.9x SDPA at seq >= 4096. Needs CUDA; writes bench/results/attention-<device>-<date>.json.

    python bench/attention.py [--seqs 1024,2048,4096,8192] [--out bench/results]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from bench_meta import result_path, run_metadata, write_json


def _flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    # QK^T and PV, 2 flops per multiply-add, half of the square under the causal mask.
    return 4.0 * batch * heads * seq * seq * head_dim / 2


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def matmul_ceiling_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (_time_ms(lambda: a @ b) * 1e-3) / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA device; nothing was measured", file=sys.stderr)
        return 2

    from kiln.codegen.flash_attn import flash_attention
    from kiln.codegen.tiles import default_tile

    b, h, d = args.batch, args.heads, args.head_dim
    tile = default_tile(d, torch.bfloat16, torch.cuda.get_device_capability())
    ceiling = matmul_ceiling_tflops()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        torch.manual_seed(seq)
        q = torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True)
        # kiln's layout is flat [B, T, H * D]; the transposes happen once, outside the timed region.
        qf, kf, vf = (t.transpose(1, 2).reshape(b, seq, h * d).contiguous() for t in (q, k, v))
        kiln = partial(flash_attention, qf, kf, vf, h, h, True, 0, d**-0.5, tile=tile)
        ref = sdpa().transpose(1, 2).reshape(b, seq, h * d)
        err = (kiln().float() - ref.float()).abs().max().item()
        assert err < 2e-2 * ref.float().abs().max().item(), f"kiln's output differs from SDPA by {err}"
        flops = _flops(b, h, seq, d)
        t_sdpa, t_kiln = _time_ms(sdpa), _time_ms(kiln)
        row = {
            "seq": seq,
            "sdpa_ms": t_sdpa,
            "kiln_ms": t_kiln,
            "sdpa_tflops": flops / (t_sdpa * 1e-3) / 1e12,
            "kiln_tflops": flops / (t_kiln * 1e-3) / 1e12,
        }
        row["kiln_vs_sdpa"] = row["kiln_tflops"] / row["sdpa_tflops"]
        row["kiln_of_ceiling"] = row["kiln_tflops"] / ceiling
        rows.append(row)
        print(f"seq {seq:5d}: sdpa {row['sdpa_tflops']:7.1f} TFLOP/s  kiln {row['kiln_tflops']:7.1f} TFLOP/s  "
              f"ratio {row['kiln_vs_sdpa']:.2f}x  ({row['kiln_of_ceiling']:.0%} of the matmul ceiling)")
    result = {
        **run_metadata(),
        "benchmark": "attention",
        "config": {"batch": b, "heads": h, "head_dim": d, "dtype": "bf16", "causal": True, "tile": tile.__dict__},
        "matmul_ceiling_tflops": ceiling,
        "rows": rows,
        "target": "kiln_vs_sdpa >= 0.9 at seq >= 4096",
        "target_met": all(r["kiln_vs_sdpa"] >= 0.9 for r in rows if r["seq"] >= 4096),
    }
    path = write_json(result_path(args.out, "attention"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
