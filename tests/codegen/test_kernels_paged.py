"""The paged-KV-cache kernels (codegen/paged.py) against kiln's reference attention on gathered K/V.

Each sequence's blocks are drawn from a shuffled pool (non-contiguous, out of order); the expected output is
ops.attention over the sequence's context gathered position by position into contiguous K/V. Outputs are
poisoned with NaN before each run; inputs are fresh and seeded per case.
"""

import pytest
import torch

from kiln.codegen._host import launch
from kiln.errors import CodegenError
from tests.support.paged_helper import LAYER, LAYERS, gathered_attention, paged_inputs

# (heads, kv_heads, head_dim, block_size, context lengths, window, num_splits, splits launched)
# Splits are whole 32-key tiles (the interpreter's BLOCK_N) of the visible span, so short spans get fewer.
DECODE = {
    "bs16-gqa4-3splits": (4, 1, 64, 16, [70, 17, 5], 0, 3, 3),
    "bs1-gqa1-2splits": (2, 2, 64, 1, [45, 9], 0, 2, 2),
    "bs16-gqa4-window7": (8, 2, 64, 16, [50, 30, 3], 7, 4, 1),
    "bs16-gqa4-window40-2splits": (8, 2, 64, 16, [75, 30, 3], 40, 2, 2),
    "bs1-d128-window5": (4, 1, 128, 1, [13, 6], 5, None, 1),
    "bs16-d8-2splits": (4, 2, 8, 16, [40, 7], 0, 2, 2),  # head_dim < 16: masked up to tl.dot's smallest K
    "bs4-d5-window6": (3, 1, 5, 4, [19, 2], 6, None, 1),
}


@pytest.mark.parametrize("case", list(DECODE))
def test_decode_matches_reference(case, monkeypatch):
    import kiln.codegen.paged as paged

    grids = []
    monkeypatch.setattr(paged, "launch", lambda t, op, grid, *a: (grids.append((t, grid)), launch(t, op, grid, *a)))
    heads, kv_heads, d, bs, ctx, window, splits, launched = DECODE[case]
    q_lens = [1] * len(ctx)
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=len(case))
    out = torch.full_like(q, float("nan"))
    got = paged.paged_attention_decode(q, cache, LAYER, bt, cl, qsl, max(ctx), heads, window, d**-0.5,
                                 num_splits=splits, out=out)  # fmt: skip
    assert got is out
    assert grids[0] == ("paged_decode", (len(ctx), kv_heads, launched)) and grids[1][0] == "paged_merge"
    want = gathered_attention(q, cache, tables, q_lens, ctx, heads, kv_heads, True, window, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_under_a_loose_bound_splits_each_context_by_its_own_length(splits, monkeypatch):
    """A CUDA graph passes max_context_len = max_model_len: the grid gets the bound's splits, but each sequence
    spreads its own keys over them, and the result matches the reference."""
    import kiln.codegen.paged as paged
    import kiln.codegen.paged_tiles as paged_tiles

    grids = []
    monkeypatch.setattr(paged, "launch", lambda t, op, grid, *a: (grids.append((t, grid)), launch(t, op, grid, *a)))
    heads, kv_heads, d, bs, ctx = 4, 2, 32, 16, [70, 9, 1]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, [1] * 3, ctx, seed=5)
    wide = torch.zeros(3, 4096 // bs, dtype=torch.int32)  # full-width tables, as a captured graph has
    wide[:, : bt.shape[1]] = bt
    got = paged.paged_attention_decode(q, cache, LAYER, wide, cl, qsl, 4096, heads, 0, d**-0.5, num_splits=splits)
    want = gathered_attention(q, cache, tables, [1] * 3, ctx, heads, kv_heads, True, 0, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grids[0][1][2] == (4 if splits else paged_tiles.choose_splits(3, kv_heads, 4096, 32, q.device))


# (heads, kv_heads, head_dim, block_size, query lengths, context lengths, causal, window)
PREFILL = {
    "bs16-gqa4-chunk-after-prefix": (4, 1, 64, 16, [7, 3, 1], [7, 20, 9], True, 0),
    "bs1-gqa1-window5": (2, 2, 64, 1, [5, 4], [5, 13], True, 5),
    "bs16-gqa4-window9-long-chunk": (8, 2, 64, 16, [37, 2], [45, 30], True, 9),
    "bs16-d128-full-window6": (2, 1, 128, 16, [9, 1], [20, 18], False, 6),
    "bs4-d8-gqa2": (4, 2, 8, 4, [11, 1], [11, 14], True, 0),
    "bs16-d3-window4": (2, 1, 3, 16, [6, 5], [6, 17], True, 4),
}


@pytest.mark.parametrize("case", list(PREFILL))
def test_prefill_matches_reference(case):
    from kiln.codegen.paged import paged_attention_prefill
    from kiln.codegen.tiles import TileConfig

    heads, kv_heads, d, bs, q_lens, ctx, causal, window = PREFILL[case]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=len(case) + 1)
    out = torch.full_like(q, float("nan"))
    tile = TileConfig(16, 16, 4, 1)  # several query and key tiles per sequence: block skipping is exercised
    got = paged_attention_prefill(q, cache, LAYER, bt, cl, qsl, max(q_lens), heads, causal, window, d**-0.5, tile,
                                  out=out)  # fmt: skip
    want = gathered_attention(q, cache, tables, q_lens, ctx, heads, kv_heads, causal, window, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_decode_and_prefill_match_the_fp32_reference(dtype):
    """16-bit q and cache (the interpreter dots them in fp32: its 16-bit tl.dot is wrong, see dot_consts)."""
    from kiln.codegen.paged import paged_attention_decode, paged_attention_prefill
    from kiln.codegen.tiles import TileConfig

    heads, kv_heads, d, bs = 4, 2, 32, 16
    for q_lens, ctx in (([1, 1], [37, 5]), ([9, 2], [9, 21])):
        q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=sum(ctx), dtype=dtype)
        if max(q_lens) == 1:
            got = paged_attention_decode(q, cache, LAYER, bt, cl, qsl, max(ctx), heads, 0, d**-0.5, num_splits=2)
        else:
            got = paged_attention_prefill(q, cache, LAYER, bt, cl, qsl, max(q_lens), heads, True, 0, d**-0.5,
                                          TileConfig(16, 16, 4, 1))  # fmt: skip
        want = gathered_attention(q, cache, tables, q_lens, ctx, heads, kv_heads, True, 0, d**-0.5)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size,d", [(1, 64), (16, 64), (4, 6)])
def test_write_equals_index_put_and_skips_padding(block_size, d):
    from kiln.codegen.paged import paged_kv_write

    kv_heads, n = 2, 9
    g = torch.Generator().manual_seed(block_size)
    cache = torch.randn(LAYERS, 2, 24 // block_size + 2, block_size, kv_heads, d, generator=g)
    slots = torch.randperm(cache.shape[2] * block_size, generator=g)[:n]
    slots[4] = -1  # a padding token
    kv = torch.randn(n, 3 * kv_heads * d, generator=g)
    k, v = kv[:, : kv_heads * d], kv[:, 2 * kv_heads * d :]  # row-strided views, as split_with_sizes makes them
    want = cache.clone()
    keep = slots >= 0
    for i, t in enumerate((k, v)):
        want[LAYER, i].view(-1, kv_heads, d).index_put_((slots[keep],), t[keep].view(-1, kv_heads, d))
    paged_kv_write(k, v, cache, LAYER, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("q_lens", [[1, 1], [4, 1]], ids=["decode", "mixed"])
def test_paged_attention_writes_then_attends_like_the_op(q_lens):
    from kiln.codegen.paged import paged_attention
    from kiln.ir.ops_paged import paged_attention as reference

    heads, kv_heads, d, bs, ctx = 4, 2, 64, 16, [21, 35]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=sum(q_lens),
                                                 dtype=torch.float16)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, sum(q_lens), kv_heads * d, generator=g).half()
    v = torch.randn(1, sum(q_lens), kv_heads * d, generator=g).half()
    rows = [(t, p) for t, ql, c in zip(tables, q_lens, ctx, strict=True) for p in range(c - ql, c)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in rows])
    args = (LAYER, slots, bt, cl, qsl, max(q_lens), max(ctx), heads, kv_heads, True, 0, d**-0.5)
    want_cache = cache.float()  # a copy the reference writes into
    want = reference(q[None].float(), k.float(), v.float(), want_cache, *args, None)
    out = torch.full_like(q[None], float("nan"))
    got = paged_attention(q[None], k, v, cache, *args, out=out)
    torch.testing.assert_close(cache.float(), want_cache, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)  # 16-bit probabilities


# A routed layer's compact batch (kiln.ir.ops_mod_step): `pad` rows after the sequences' rows (query_start_loc[S]
# < N, slot -1), and sequences with no routed row. (query lengths, context lengths, pad): decode path when every
# sequence has at most one row; 37 padding rows outrun the prefill grid's one 16-row query block (a strided loop).
PADDED = {
    "decode": ([1, 0, 1, 1], [9, 3, 17, 4], 5),
    "prefill": ([3, 0, 2], [7, 2, 12], 37),
    "prefill-no-padding": ([2, 5], [5, 6], 0),
}


@pytest.mark.parametrize("case", list(PADDED))
def test_rows_past_the_last_sequence_are_zeros_as_in_the_reference(case):
    from kiln.codegen.paged import paged_attention
    from kiln.codegen.tiles import TileConfig
    from kiln.ir.ops_paged import paged_attention as reference

    q_lens, ctx, pad = PADDED[case]
    heads, kv_heads, d, bs = 6, 2, 48, 4  # GQA 3, head_dim 48 (not a power of two)
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=len(case))
    real, g = q.shape[0], torch.Generator().manual_seed(7)
    q = torch.cat([q, torch.randn(pad, q.shape[1], generator=g)])[None]
    k, v = (torch.randn(1, real + pad, kv_heads * d, generator=g) for _ in range(2))
    rows = [(t, p) for t, ql, c in zip(tables, q_lens, ctx, strict=True) for p in range(c - ql, c)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in rows] + [-1] * pad)
    args = (LAYER, slots, bt, cl, qsl, max(q_lens), max(ctx), heads, kv_heads, True, 0, d**-0.5)
    want_cache = cache.clone()
    want = reference(q, k, v, want_cache, *args, None)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k, v, cache, *args, tile=TileConfig(16, 16, 4, 1), out=out)
    assert torch.equal(cache, want_cache)  # padding rows wrote nothing
    assert torch.equal(got[0, real:], torch.zeros(pad, heads * d)) and torch.equal(want[0, real:], got[0, real:])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_paged_kernels_reject_bad_inputs():
    from kiln.codegen.paged import paged_attention_decode, paged_kv_write

    q, cache, _, bt, cl, qsl = paged_inputs(4, 2, 64, 16, [1, 1], [5, 9], seed=0)
    args = (bt, cl, qsl, 9, 4, 0, 0.125)
    with pytest.raises(CodegenError, match="kv_cache must have 6 dims"):
        paged_attention_decode(q, cache[0], LAYER, *args)
    with pytest.raises(CodegenError, match="layer 2 is outside"):
        paged_attention_decode(q, cache, 2, *args)
    with pytest.raises(CodegenError, match="block_tables has dtype"):
        paged_attention_decode(q, cache, LAYER, bt.long(), *args[1:])
    with pytest.raises(CodegenError, match="same S sequences"):
        paged_attention_decode(q, cache, LAYER, bt, cl, qsl[:2], *args[3:])
    with pytest.raises(CodegenError, match="q has 128 features"):
        paged_attention_decode(q[:, :128], cache, LAYER, *args)
    with pytest.raises(CodegenError, match="q has dtype"):
        paged_attention_decode(q.half(), cache, LAYER, *args)
    with pytest.raises(CodegenError, match="k has shape"):
        paged_kv_write(q, q, cache, LAYER, torch.tensor([0, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens", [[1] * 24, [300, 1, 64, 1]], ids=["decode-24", "mixed-prefill"])
def test_paged_attention_real_size_on_gpu(q_lens, dtype):
    """Llama-8B-like heads at real lengths, default splits and tiles (not run without CUDA)."""
    from kiln.codegen.paged import paged_attention
    from kiln.ir.ops_paged import paged_attention as reference

    heads, kv_heads, d, bs = 32, 8, 128, 16
    g = torch.Generator().manual_seed(len(q_lens))
    ctx = [int(q) + int(torch.randint(0, 1500, (1,), generator=g)) for q in q_lens]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=len(q_lens), dtype=dtype)
    q, cache, bt, cl, qsl = (t.cuda() for t in (q, cache, bt, cl, qsl))
    k = torch.randn(1, sum(q_lens), kv_heads * d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    rows = [(t, p) for t, ql, c in zip(tables, q_lens, ctx, strict=True) for p in range(c - ql, c)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in rows], device="cuda")
    args = (LAYER, slots, bt, cl, qsl, max(q_lens), max(ctx), heads, kv_heads, True, 0, d**-0.5)
    want_cache = cache.float()
    want = reference(q[None].float(), k.float(), v.float(), want_cache, *args, None)
    got = paged_attention(q[None], k, v, cache, *args, out=torch.full_like(q[None], float("nan")))
    torch.testing.assert_close(cache.float(), want_cache, rtol=0, atol=0)
    assert not got.isnan().any()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert (got.float() - want).abs().max().item() <= tol * max(want.abs().max().item(), 1.0)
