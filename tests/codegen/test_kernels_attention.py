"""The flash-attention kernel (codegen/templates/flash_attn.py.j2) against kiln's reference attention.

Each case is one interpreted launch, so the matrix is chosen, not a full product: it covers seq lengths
1/17/100, GQA ratios 1/4/8, head dims 64/128 (80 and 256 once), causal and not, windows shorter and
longer than the sequence, cached prefixes (S > T), several tiles per sequence (block skipping) and varlen.
"""


import pytest
import torch

from kiln.errors import CodegenError
from kiln.ir import ops

# (batch, T, S, heads, kv_heads, head_dim, causal, window, tile)
CASES = {
    "t1": (1, 1, 1, 2, 2, 64, True, 0, None),
    "t17-gqa4-causal": (2, 17, 17, 4, 1, 64, True, 0, None),
    "t17-d128-full": (1, 17, 17, 2, 2, 128, False, 0, None),
    "t100-gqa8-causal": (1, 100, 100, 8, 1, 64, True, 0, None),
    "t100-d128-window7-16x16": (1, 100, 100, 4, 1, 128, True, 7, (16, 16)),
    "t100-full-window20-16x32": (1, 100, 100, 2, 2, 64, False, 20, (16, 32)),
    "t17-window40": (1, 17, 17, 4, 4, 64, True, 40, None),
    "t17-d80-full-window5": (1, 17, 17, 4, 1, 80, False, 5, None),
    "t17-d256": (1, 17, 17, 2, 1, 256, True, 0, None),
    "prefix-t17-s40": (2, 17, 40, 4, 1, 64, True, 0, (16, 16)),
    "prefix-t17-s100-window30": (1, 17, 100, 8, 1, 128, True, 30, (16, 16)),
    "decode-t1-s30-gqa8": (1, 1, 30, 8, 1, 64, True, 0, None),
    "t17-d8-gqa2": (1, 17, 17, 4, 2, 8, True, 0, None),  # tiny test models' head size, masked up to 16
}


def _inputs(b, t, s, heads, kv_heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads * d, generator=g)
    k = torch.randn(b, s, kv_heads * d, generator=g)
    v = torch.randn(b, s, kv_heads * d, generator=g)
    return q, k, v


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_matches_reference(case):
    from kiln.codegen.flash_attn import flash_attention
    from kiln.codegen.tiles import TileConfig

    b, t, s, heads, kv_heads, d, causal, window, tile = CASES[case]
    q, k, v = _inputs(b, t, s, heads, kv_heads, d, seed=len(case) * 31 + t)
    tile_cfg = TileConfig(tile[0], tile[1], 4, 1) if tile else None
    out = torch.full_like(q, float("nan"))
    got = flash_attention(q, k, v, heads, kv_heads, causal, window, d**-0.5, tile_cfg, out=out)
    assert got is out
    ref = ops.attention(q, k, v, heads, kv_heads, causal, window, d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("causal", "window"), [(True, 0), (False, 9)])
def test_flash_attention_varlen_matches_per_sequence_reference(causal, window):
    from kiln.codegen.flash_attn import flash_attention_varlen
    from kiln.codegen.tiles import TileConfig

    heads, kv_heads, d = 4, 1, 64
    q_lens, k_lens = [5, 17, 30], [5, 25, 30]  # the middle sequence has a cached prefix
    g = torch.Generator().manual_seed(7 + window)
    qs = [torch.randn(n, heads * d, generator=g) for n in q_lens]
    ks = [torch.randn(n, kv_heads * d, generator=g) for n in k_lens]
    vs = [torch.randn(n, kv_heads * d, generator=g) for n in k_lens]
    cu_q = torch.tensor([0, 5, 22, 52], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 30, 60], dtype=torch.int32)
    q = torch.cat(qs)
    out = torch.full_like(q, float("nan"))
    tile = TileConfig(16, 16, 4, 1)
    got = flash_attention_varlen(
        q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, 30, 30, heads, kv_heads, causal, window, 0.1, tile, out=out
    )
    for i in range(3):
        ref = ops.attention(qs[i][None], ks[i][None], vs[i][None], heads, kv_heads, causal, window, 0.1)[0]
        torch.testing.assert_close(got[cu_q[i] : cu_q[i + 1]], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
    ],
)
def test_flash_attention_16bit_on_fused_qkv_views(dtype):
    from kiln.codegen.flash_attn import flash_attention

    heads, kv_heads, d, t = 4, 2, 64, 17
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views, no copies
    got = flash_attention(q, k, v, heads, kv_heads, True, 0, d**-0.5, out=torch.full_like(q, float("nan")))
    ref = ops.attention(q.float(), k.float(), v.float(), heads, kv_heads, True, 0, d**-0.5)
    # 16-bit probabilities feed the second product: compare to the fp32 reference loosely.
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_default_tile_table():
    from kiln.codegen.tiles import INTERPRETER_TILE, TileConfig, default_tile

    assert default_tile(128, torch.bfloat16, None) == INTERPRETER_TILE
    h100_64, h100_256 = default_tile(64, torch.bfloat16, (9, 0)), default_tile(256, torch.bfloat16, (9, 0))
    assert h100_256.block_m * h100_256.block_n < h100_64.block_m * h100_64.block_n
    assert default_tile(128, torch.float32, (8, 0)).block_n <= default_tile(128, torch.float16, (8, 0)).block_n
    for d in (64, 80, 96, 128, 256):
        for cap in (None, (7, 5), (8, 0), (9, 0)):
            default_tile(d, torch.float16, cap).validate()
    with pytest.raises(CodegenError, match="block_n"):
        TileConfig(64, 24, 4, 2).validate()
    with pytest.raises(CodegenError, match="head_dim"):
        default_tile(512, torch.float16, (9, 0))


def test_flash_attention_rejects_bad_inputs():
    from kiln.codegen.flash_attn import flash_attention, flash_attention_varlen

    q, k, v = _inputs(1, 5, 5, 4, 2, 64, seed=9)
    with pytest.raises(CodegenError, match="multiple of num_kv_heads"):
        flash_attention(q, k, v, 4, 3, True, 0, 0.125)
    with pytest.raises(CodegenError, match="k has 128 features"):
        flash_attention(q, k, v, 4, 1, True, 0, 0.125)
    with pytest.raises(CodegenError, match="v has dtype"):
        flash_attention(q, k, v.double(), 4, 2, True, 0, 0.125)
    wide = torch.randn(1, 5, 512)
    with pytest.raises(CodegenError, match="head_dim 512"):
        flash_attention(wide, wide, wide, 1, 1, True, 0, 0.125)
    cu = torch.tensor([0, 5], dtype=torch.int64)
    with pytest.raises(CodegenError, match="cu_seqlens_q has dtype"):
        flash_attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5, 4, 2, True, 0, 0.125)


@pytest.mark.parametrize("shape", [(0, 5, 5), (2, 0, 0), (2, 0, 3)], ids=["no-batch", "no-tokens", "no-queries"])
def test_flash_attention_on_empty_inputs_returns_an_empty_result(shape):
    from kiln.codegen.flash_attn import flash_attention, flash_attention_varlen

    b, t, s = shape
    q, k, v = torch.randn(b, t, 4 * 64), torch.randn(b, s, 2 * 64), torch.randn(b, s, 2 * 64)
    out = flash_attention(q, k, v, 4, 2, True, 0, 0.125)
    assert out.shape == q.shape and out.numel() == 0
    cu = torch.zeros(2, dtype=torch.int32)
    assert flash_attention_varlen(q.reshape(-1, 256), k.reshape(-1, 128), v.reshape(-1, 128), cu, cu, 0, 0, 4, 2,
                                  True, 0, 0.125, tma=False).numel() == 0


def test_shared_memory_limits_by_capability():
    from kiln.codegen.tiles import shared_memory_limit

    assert [shared_memory_limit(c) for c in ((9, 0), (10, 0), (8, 0), (8, 6), (8, 9), (12, 0), (7, 5))] == [
        232448, 232448, 166912, 101376, 101376, 101376, 65536]


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
def test_default_fp32_tiles_fit_the_shared_memory_of_every_part(capability):
    from kiln.codegen.tiles import default_tile, shared_memory_estimate, shared_memory_limit

    """fp32 tiles within sm90's measured bound (an upper bound elsewhere); the 16-bit rows are the table's."""
    for head_dim in (32, 64, 80, 96, 128, 160, 256):
        tile = default_tile(head_dim, torch.float32, capability)
        assert shared_memory_estimate(tile, head_dim, torch.float32) <= shared_memory_limit(capability), head_dim
    assert default_tile(128, torch.bfloat16, (9, 0)) == default_tile(128, torch.bfloat16, (8, 6))
    assert default_tile(128, torch.float32, (9, 0)).block_m == 2 * default_tile(128, torch.float32, (8, 6)).block_m
