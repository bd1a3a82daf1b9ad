"""Example positional arguments for every KERNEL_TABLE op: odd small shapes for the interpreter, real sizes for a GPU
(and for the sm90 compile test, which records the launches they cause)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.quant.formats import parse_scheme, quantize_rtn

kiln_ops = torch.ops.kiln

def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _quantized(g, n, k, scheme, device):
    qw = quantize_rtn(torch.randn(n, k, generator=g) * k**-0.5, parse_scheme(scheme))
    zeros = qw.zeros.to(device) if qw.zeros is not None else None
    return qw.qweight.to(device), qw.scales.to(device), zeros, qw


def kernel_examples(size: str, dtype: torch.dtype, device: str) -> dict[object, Callable[[], tuple]]:
    """op -> a builder of its positional arguments. size "small": odd CPU shapes; "real": GPU-sized."""
    small = size == "small"
    g = torch.Generator().manual_seed(0)
    rows, d, ffn = (7, 40, 52) if small else (1031, 2048, 8192)
    heads, kv_heads, hd = (4, 2, 16) if small else (32, 8, 128)
    seq = 13 if small else 1531
    r = lambda *s, scale=1.0: _rand(g, *s, dtype=dtype, device=device, scale=scale)  # noqa: E731
    ids = lambda n: torch.randint(0, 97, (1, n), generator=g).to(device)  # noqa: E731
    pos = torch.arange(seq, device=device)[None]
    inv_freq = (10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(device)
    qkv = lambda: (r(1, seq, heads * hd), r(1, seq, kv_heads * hd), r(1, seq, kv_heads * hd))  # noqa: E731
    attn = (heads, kv_heads, True, 5 if small else 0, hd**-0.5)
    tile = (16, 16, 4, 1) if small else (128, 64, 8, 3)
    group = 32 if small else 128
    k4 = 96 if small else d

    def w8():
        qweight, scales, _, _ = _quantized(g, 24 if small else 2048, d, "int8", device)
        return r(rows, d), qweight, scales, None

    def w4():
        qweight, scales, zeros, _ = _quantized(g, 24 if small else 2048, k4, f"int4-g{group}-asym", device)
        return r(rows, k4), qweight, scales, zeros, group, r(24 if small else 2048)

    def emb_q():
        qweight, scales, zeros, qw = _quantized(g, 97, k4, f"int4-g{group}", device)
        return qweight, scales, zeros, ids(5), 4, group, dtype

    def verify():  # fp32 whatever the model dtype (kiln.step.VerifyBatch); outputs are token ids, compared exactly
        b, k, v = (3, 2, 33) if small else (64, 4, 32000)
        probs = lambda *s: torch.softmax(torch.randn(*s, generator=g) * 3, -1).to(device)  # noqa: E731
        tokens = torch.randint(0, v, (b, k), generator=g).to(device)
        num = torch.randint(0, k + 1, (b,), generator=g).to(device=device, dtype=torch.int32)
        noise = torch.empty(b, v).exponential_(generator=g).to(device)
        return probs(b, k + 1, v), tokens, probs(b, k, v), num, torch.rand(b, k, generator=g).to(device), noise

    def routed_mask(n: int):
        return (torch.rand(n, seq, generator=g) < 0.5).to(device)

    def routed_rows():  # a consistent (x, ys, r, index, count) for mod_scatter
        x, pos2 = r(2, seq, d), torch.arange(seq, device=device).expand(2, seq).contiguous()
        score, index, count, xs, _ = kiln_ops.mod_route(x, pos2, r(1, d, scale=d**-0.5), r(1), r(1, scale=0.0))
        return x, xs + r(*xs.shape), score, index, count

    def kv_slots():  # a flat batch of 3 sequences (4, 1 and 6 new tokens), routed layer 1 of 2, blocks of 4
        x, flat = r(1, 11, d), torch.arange(11, device=device)[None]
        index, count, _, _ = kiln_ops.mod_gather(x, flat, (torch.rand(1, 11, generator=g) < 0.5).to(device), 1.0)
        i32 = dict(dtype=torch.int32, device=device)
        tables = torch.randint(1, 9, (2, 3, 4), generator=g).to(**i32)
        cache = torch.empty(2, 2, 9, 4, kv_heads, hd, device=device)
        return (index, count, torch.tensor([0, 4, 5, 11], **i32), torch.tensor([[3, 0, 7], [2, 5, 0]], **i32),
                tables, cache, 1)

    pos2 = torch.arange(seq, device=device).expand(2, seq).contiguous()
    return {
        kiln_ops.mod_route.default: lambda: (r(2, seq, d), pos2, r(1, d, scale=d**-0.5), r(1), r(1, scale=0.0)),
        kiln_ops.mod_gather.default: lambda: (r(2, seq, d), pos2, routed_mask(2), 1.0),
        kiln_ops.mod_scatter.default: routed_rows,
        kiln_ops.mod_router.default: lambda: (r(2, seq, d), r(1, d, scale=d**-0.5), r(1)),
        kiln_ops.mod_predictor.default: lambda: (r(2, seq, d), r(8, d, scale=d**-0.5), r(8), r(1, 8), r(1)),
        kiln_ops.mod_topk_mask.default: lambda: (r(2, seq), 0.3),
        kiln_ops.mod_threshold_mask.default: lambda: (r(2, seq), r(1)),
        kiln_ops.routed_attention.default: lambda: (*qkv(), routed_mask(1), *attn),
        kiln_ops.mod_combine.default: lambda: (r(2, seq, d), r(2, seq, d), r(2, seq), routed_mask(2)),
        kiln_ops.mod_kv_slots.default: kv_slots,
        # the body's compact tensors cut to the routed rows (no kernel: views of the first rows, on any device)
        kiln_ops.mod_narrow.default: lambda: (torch.tensor([3], device=device), [ids(seq), r(1, seq, d),
                                                                                 ids(seq)[0]], 1, 4),
        kiln_ops.embedding.default: lambda: (r(97, d), ids(seq)),
        kiln_ops.linear.default: lambda: (r(rows, d), r(24, d, scale=d**-0.5), r(24)),
        kiln_ops.add.default: lambda: (r(rows, d), r(rows, d)),
        kiln_ops.rms_norm.default: lambda: (r(rows, d), r(d), 1e-5),
        # q of a fused qkv projection: a row-strided view, normalized per head
        kiln_ops.head_rms_norm.default: lambda: (r(1, seq, (heads + 2 * kv_heads) * hd)[..., : heads * hd], r(hd),
                                                 1e-6),
        kiln_ops.layer_norm.default: lambda: (r(rows, d), r(d), r(d), 1e-5),
        kiln_ops.add_rms_norm.default: lambda: (r(rows, d), r(rows, d), r(d), 1e-5),
        kiln_ops.add_layer_norm.default: lambda: (r(rows, d), r(rows, d), r(d), r(d), 1e-5),
        kiln_ops.rope.default: lambda: (r(1, seq, (heads + kv_heads) * hd), pos, inv_freq),
        # the q|k columns of a fused qkv projection (a row-strided view): q/k norms, then rope, in one kernel
        kiln_ops.qk_norm_rope.default: lambda: (r(1, seq, (heads + 2 * kv_heads) * hd)[..., : (heads + kv_heads) * hd],
                                                r(hd), r(hd), heads * hd, 1e-6, pos, inv_freq),
        kiln_ops.gated_act.default: lambda: (r(rows, ffn), r(rows, ffn), "silu"),
        kiln_ops.act.default: lambda: (r(rows, ffn), "gelu_tanh"),
        kiln_ops.attention.default: lambda: (*qkv(), *attn),
        kiln_ops.flash_attention.default: lambda: (*qkv(), *attn, *tile),
        kiln_ops.paged_attention.default: None,  # a whole step over a paged cache: tests/test_kernels_paged.py
        kiln_ops.linear_w8.default: w8,
        kiln_ops.linear_w4.default: w4,
        kiln_ops.embedding_q.default: emb_q,
        kiln_ops.spec_verify.default: verify,
    }
