"""The attention kernels' split key loops (masked edge tiles, unmasked interior tiles) against the reference.

The interior tiles load K/V without bounds, so every case poisons the memory just past each sequence's keys
(and the paged cache's unused slots) with NaN: a tile wrongly taken as interior reads it and the output turns
NaN, and one that skips the causal or window mask attends keys it must not and differs from the reference.
Shapes are chosen so every range occurs: lengths that are not a multiple of the tile, windows smaller and
larger than a tile, fewer queries than keys (a cached prefix), GQA groups 1/2/4, head dims 64 and 128.
"""

from __future__ import annotations

import pytest
import torch

from kiln.codegen.tiles import TileConfig
from kiln.ir import ops
from tests.support.paged_helper import shuffled_block_tables

NAN = float("nan")

# (T, S, heads, kv_heads, head_dim, causal, window, (block_m, block_n))
FLASH = {
    "t45-causal-gqa4-16x16": (45, 45, 4, 1, 64, True, 0, (16, 16)),
    "t45-causal-d128-32x16": (45, 45, 2, 2, 128, True, 0, (32, 16)),
    "t37-causal-gqa2-16x32": (37, 37, 4, 2, 64, True, 0, (16, 32)),
    "prefix-t19-s50-gqa2": (19, 50, 4, 2, 64, True, 0, (16, 16)),
    "prefix-t19-s50-window7": (19, 50, 2, 1, 128, True, 7, (16, 16)),
    "t50-window40-gqa4": (50, 50, 4, 1, 64, True, 40, (16, 16)),
    "t50-window5-32x16": (50, 50, 2, 2, 64, True, 5, (32, 16)),
    "t41-full-seq-end": (41, 41, 2, 1, 64, False, 0, (16, 16)),
    "t41-full-window20": (41, 41, 2, 2, 128, False, 20, (16, 16)),
    "prefix-t9-s41-full-window6": (9, 41, 2, 1, 64, False, 6, (16, 16)),
}


TMA_CASES = ["t45-causal-gqa4-16x16", "prefix-t19-s50-window7", "t41-full-window20", "t50-window5-32x16"]


@pytest.mark.parametrize(("case", "tma"), [(c, False) for c in FLASH] + [(c, True) for c in TMA_CASES])
def test_flash_attention_split_loop_matches_reference(case, tma):
    from kiln.codegen.flash_attn import flash_attention

    t, s, heads, kv_heads, d, causal, window, (bm, bn) = FLASH[case]
    g = torch.Generator().manual_seed(len(case) * 7 + s)
    q = torch.randn(1, t, heads * d, generator=g)
    # K/V are views of buffers whose rows past S hold NaN: an unbounded load past the keys poisons the output.
    k_buf = torch.full((1, s + 2 * bn, kv_heads * d), NAN)
    v_buf = torch.full_like(k_buf, NAN)
    k_buf[:, :s] = torch.randn(1, s, kv_heads * d, generator=g)
    v_buf[:, :s] = torch.randn(1, s, kv_heads * d, generator=g)
    k, v = k_buf[:, :s], v_buf[:, :s]
    out = torch.full_like(q, NAN)
    got = flash_attention(q, k, v, heads, kv_heads, causal, window, d**-0.5, TileConfig(bm, bn, 4, 1), out=out,
                          tma=tma)  # fmt: skip
    ref = ops.attention(q, k.contiguous(), v.contiguous(), heads, kv_heads, causal, window, d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def _poisoned_cache(kv_heads, d, block_size, ctx_lens, seed):
    """A paged cache whose slots past each context (and unassigned blocks) hold NaN, and its block tables."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(ctx_lens, block_size, seed)
    cache = torch.full((1, 2, num_blocks, block_size, kv_heads, d), NAN)
    for table, ctx in zip(tables, ctx_lens, strict=True):
        for p in range(ctx):
            cache[0, :, table[p // block_size], p % block_size] = torch.randn(2, kv_heads, d, generator=g)
    bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return cache, tables, bt


def _expected(q, cache, tables, q_lens, ctx_lens, heads, kv_heads, causal, window, scale):
    block_size, d = cache.shape[3], cache.shape[-1]
    outs, at = [], 0
    for table, q_len, ctx in zip(tables, q_lens, ctx_lens, strict=True):
        where = [(table[p // block_size], p % block_size) for p in range(ctx)]
        k = torch.stack([cache[0, 0, b, o] for b, o in where]).reshape(1, ctx, kv_heads * d)
        v = torch.stack([cache[0, 1, b, o] for b, o in where]).reshape(1, ctx, kv_heads * d)
        outs.append(ops.attention(q[at : at + q_len][None], k, v, heads, kv_heads, causal, window, scale)[0])
        at += q_len
    return torch.cat(outs)


# (heads, kv_heads, head_dim, block_size, query lengths, context lengths, causal, window)
PREFILL = {
    "gqa4-prefix-and-whole": (4, 1, 64, 16, [19, 35], [50, 35], True, 0),
    "gqa2-d128-window7": (4, 2, 128, 16, [33, 5], [33, 40], True, 7),
    "gqa1-window40": (2, 2, 64, 8, [45], [45], True, 40),
    "gqa2-full-window6": (4, 2, 64, 16, [9, 20], [41, 20], False, 6),
}


@pytest.mark.parametrize("case", list(PREFILL))
def test_paged_prefill_split_loop_matches_reference(case):
    from kiln.codegen.paged import paged_attention_prefill

    heads, kv_heads, d, bs, q_lens, ctx, causal, window = PREFILL[case]
    cache, tables, bt = _poisoned_cache(kv_heads, d, bs, ctx, seed=len(case))
    q = torch.randn(sum(q_lens), heads * d, generator=torch.Generator().manual_seed(3))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cl = torch.tensor(ctx, dtype=torch.int32)
    out = torch.full_like(q, NAN)
    got = paged_attention_prefill(q, cache, 0, bt, cl, qsl, max(q_lens), heads, causal, window, d**-0.5,
                                  TileConfig(16, 16, 4, 1), out=out)  # fmt: skip
    want = _expected(q, cache, tables, q_lens, ctx, heads, kv_heads, causal, window, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# (heads, kv_heads, head_dim, block_size, context lengths, window, num_splits, block_n of the decode tile)
DECODE = {
    "gqa4-tails-3splits": (4, 1, 64, 16, [77, 33, 5], 0, 3, None),
    "gqa2-d128-1split": (4, 2, 128, 16, [70, 32], 0, 1, None),
    "gqa1-window45-2splits": (2, 2, 64, 8, [90, 12], 45, 2, None),
    "gqa4-16-key-tiles-window20": (8, 2, 64, 16, [61, 40], 20, 2, 16),
}


@pytest.mark.parametrize("case", list(DECODE))
def test_paged_decode_split_loop_matches_reference(case):
    from kiln.codegen.paged import paged_attention_decode

    heads, kv_heads, d, bs, ctx, window, splits, block_n = DECODE[case]
    tile = TileConfig(16, block_n, 4, 1) if block_n else None
    cache, tables, bt = _poisoned_cache(kv_heads, d, bs, ctx, seed=len(case) + 2)
    q = torch.randn(len(ctx), heads * d, generator=torch.Generator().manual_seed(4))
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32)
    cl = torch.tensor(ctx, dtype=torch.int32)
    out = torch.full_like(q, NAN)
    got = paged_attention_decode(q, cache, 0, bt, cl, qsl, max(ctx), heads, window, d**-0.5, num_splits=splits,
                                 out=out, tile=tile)  # fmt: skip
    want = _expected(q, cache, tables, [1] * len(ctx), ctx, heads, kv_heads, True, window, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_decode_tile_must_cover_the_head_group():
    from kiln.codegen.paged import paged_attention_decode
    from kiln.errors import CodegenError

    cache, _, bt = _poisoned_cache(2, 64, 16, [20], seed=1)
    q = torch.randn(1, 4 * 64)
    args = (q, cache, 0, bt, torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 20, 4,
            0, 0.125)  # fmt: skip
    with pytest.raises(CodegenError, match="block_m = 16 .the 2 query heads of a kv head"):
        paged_attention_decode(*args, tile=TileConfig(32, 32, 4, 1))


def test_flash_attention_varlen_through_tma_descriptors():
    """Descriptor tiles run past a sequence into the next one's rows (or zeros past the tensor): masked."""
    from kiln.codegen.flash_attn import flash_attention_varlen

    heads, kv_heads, d = 4, 2, 64
    q_lens, k_lens = [5, 17, 30], [5, 25, 30]
    g = torch.Generator().manual_seed(11)
    qs = [torch.randn(n, heads * d, generator=g) * 3 for n in q_lens]
    ks = [torch.randn(n, kv_heads * d, generator=g) * 3 for n in k_lens]
    vs = [torch.randn(n, kv_heads * d, generator=g) for n in k_lens]
    cu_q = torch.tensor([0, 5, 22, 52], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 30, 60], dtype=torch.int32)
    q = torch.cat(qs)
    for causal, window in ((True, 0), (False, 9)):
        got = flash_attention_varlen(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, 30, 30, heads, kv_heads, causal,
                                     window, 0.1, TileConfig(16, 16, 4, 1), out=torch.full_like(q, NAN), tma=True)
        for i in range(3):
            ref = ops.attention(qs[i][None], ks[i][None], vs[i][None], heads, kv_heads, causal, window, 0.1)[0]
            torch.testing.assert_close(got[cu_q[i] : cu_q[i + 1]], ref, rtol=1e-4, atol=1e-5)


def test_tma_refuses_what_it_cannot_load():
    from kiln.codegen.flash_attn import flash_attention
    from kiln.errors import CodegenError

    q = torch.randn(1, 9, 2 * 80)
    with pytest.raises(CodegenError, match="head_dim 80 is not a power of two"):
        flash_attention(q, q, q, 2, 2, True, 0, 0.1, tma=True)
    odd = torch.randn(1, 9, 2 * 64 + 1)[..., 1:]  # rows start 4 bytes off a 16-byte boundary
    with pytest.raises(CodegenError, match="q's rows are not 16-byte aligned"):
        flash_attention(odd, odd, odd, 2, 2, True, 0, 0.1, tma=True)
    got = flash_attention(odd, odd, odd, 2, 2, True, 0, 0.1)  # None: falls back to pointer loads
    torch.testing.assert_close(got, ops.attention(odd, odd, odd, 2, 2, True, 0, 0.1), rtol=1e-4, atol=1e-5)
