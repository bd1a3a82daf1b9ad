"""GPU suite (marker `gpu`, skipped without CUDA): every autotuning candidate tile of the flash kernel gives the
reference's result at a real size, and tuning on the GPU writes its cache and a later lookup reads it."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import ops

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_candidate_tile_matches_the_reference(dtype, head_dim):
    from kiln.codegen.flash_attn import flash_attention
    from kiln.codegen.tiles import candidate_tiles

    torch.manual_seed(head_dim)
    heads, kv_heads, t, s = 32, 8, 1000, 1100  # neither a multiple of any tile; a 100-key cached prefix
    q = torch.randn(2, t, heads * head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, s, kv_heads * head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    ref = ops.attention(q, k, v, heads, kv_heads, True, 0, head_dim**-0.5).float()
    for tile in candidate_tiles(head_dim, dtype, torch.cuda.get_device_capability()):
        got = flash_attention(q, k, v, heads, kv_heads, True, 0, head_dim**-0.5, tile,
                              out=torch.full_like(q, float("nan")))  # fmt: skip
        err = (got.float() - ref).abs().max().item()
        assert err <= TOL[dtype] * max(ref.abs().max().item(), 1.0), f"{tile}: max abs error {err:.3e}"


def test_tuning_on_the_gpu_is_cached_and_reused(tmp_path, monkeypatch):
    from kiln.codegen import autotune
    from kiln.codegen.tiles import candidate_tiles
    from kiln.passes.flash_tiling import tuned_tile

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_memo", {})
    before = autotune.stats().tuned, autotune.stats().loaded
    cuda = torch.device("cuda", torch.cuda.current_device())
    tile = tuned_tile(cuda, torch.float16, 64, 32, 8, True, 0, 0.125)
    assert tile in candidate_tiles(64, torch.float16, torch.cuda.get_device_capability())
    assert len(list((tmp_path / "autotune").glob("flash_attn_*.json"))) == 1
    monkeypatch.setattr(autotune, "_memo", {})  # as a new process would start
    assert tuned_tile(cuda, torch.float16, 64, 32, 8, True, 0, 0.125) == tile
    assert (autotune.stats().tuned - before[0], autotune.stats().loaded - before[1]) == (1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "window"), [(64, 0), (128, 0), (128, 300)])
def test_tma_variant_matches_the_reference(dtype, head_dim, window):
    """KILN_FLASH_TMA's path (sm90+): packed sequences, so descriptor tiles run into the next sequence's rows."""
    from kiln.codegen.flash_attn import flash_attention_varlen

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90+")
    torch.manual_seed(head_dim + window)
    heads, kv_heads = 32, 8
    q_lens, k_lens = [1, 700, 1024, 77], [1, 900, 1024, 77]
    q = torch.randn(sum(q_lens), heads * head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(k_lens), kv_heads * head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    got = flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), heads, kv_heads, True, window,
                                 head_dim**-0.5, out=torch.full_like(q, float("nan")), tma=True)  # fmt: skip
    for i in range(len(q_lens)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref = ops.attention(q[None, qs], k[None, ks], v[None, ks], heads, kv_heads, True, window, head_dim**-0.5)[0]
        err = (got[qs].float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype] * max(ref.float().abs().max().item(), 1.0), f"sequence {i}: max abs error {err:.3e}"
