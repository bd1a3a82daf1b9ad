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
