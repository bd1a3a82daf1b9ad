"""The fused q/k norm + rope kernel (codegen/templates/rope.py.j2 with NORM on: kiln::qk_norm_rope) against the
reference op and against the two unfused kernels it replaces (head_rms_norm, then rope)."""

import pytest
import torch

from kiln.errors import CodegenError
from kiln.ir import ops_level2  # noqa: F401  (registers kiln::qk_norm_rope)
from tests.support.rope import llama3_inv_freq

qk_norm_rope_ref = torch.ops.kiln.qk_norm_rope


def _site(b, t, q_heads, k_heads, d, dtype, seed):
    """(qk, q_weight, k_weight, positions, inv_freq): qk the q|k columns of a fused qkv projection (a strided view),
    weights that differ between q and k, so a swapped or shared weight shows."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, (q_heads + 2 * k_heads) * d, generator=g) * 3 + 0.5
    qk = qkv.to(dtype)[..., : (q_heads + k_heads) * d]
    q_w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    k_w = (torch.randn(d, generator=g) * 2).to(dtype)
    positions = torch.randint(0, 4096, (b, t), generator=g)
    return qk, q_w, k_w, positions, llama3_inv_freq(d)


def _unfused(qk, q_w, k_w, q_features, eps, positions, inv_freq):
    """The four launches the fused kernel replaces: head_rms_norm on q and on k, then rope on each."""
    from kiln.codegen.norm import head_rms_norm
    from kiln.codegen.rope import rope

    q, k = qk[..., :q_features], qk[..., q_features:]
    return torch.cat((rope(head_rms_norm(q, q_w, eps), positions, inv_freq),
                      rope(head_rms_norm(k, k_w, eps), positions, inv_freq)), -1)  # fmt: skip


@pytest.mark.parametrize(
    ("b", "t", "q_heads", "k_heads", "d"),
    [(1, 1, 1, 1, 16), (2, 17, 3, 1, 32), (1, 13, 5, 3, 24), (2, 5, 7, 7, 64), (1, 9, 4, 2, 80), (1, 3, 8, 1, 128)],
)
def test_qk_norm_rope_matches_reference(b, t, q_heads, k_heads, d):
    from kiln.codegen.rope import qk_norm_rope

    qk, q_w, k_w, positions, inv_freq = _site(b, t, q_heads, k_heads, d, torch.float32, seed=t * 100 + q_heads * d)
    args = (qk, q_w, k_w, q_heads * d, 1e-6, positions, inv_freq)
    out = torch.full(qk.shape, float("nan"))
    got = qk_norm_rope(*args, out=out)
    assert got is out
    torch.testing.assert_close(got, qk_norm_rope_ref(*args), rtol=1e-5, atol=1e-5)


def test_a_block_of_heads_that_straddles_q_and_k(monkeypatch):
    """Blocks of 4 heads over 5 q heads and 3 k heads: the second block holds q's last head and k's three."""
    from kiln.codegen import rope as rope_mod

    monkeypatch.setattr(rope_mod, "_MAX_TILE", 32)  # BLOCK_HALF 8 -> BLOCK_H 4
    qk, q_w, k_w, positions, inv_freq = _site(2, 7, 5, 3, 16, torch.float32, seed=3)
    args = (qk, q_w, k_w, 5 * 16, 1e-6, positions, inv_freq)
    torch.testing.assert_close(rope_mod.qk_norm_rope(*args), qk_norm_rope_ref(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("q_heads", "k_heads", "d"), [(5, 3, 24), (4, 2, 64), (8, 1, 128)])
def test_16_bit_rounds_as_the_unfused_kernels(dtype, q_heads, k_heads, d):
    """The norm's output is rounded to the activation dtype before the rotation, as between the unfused kernels:
    the fused kernel gives their bits, but for a rare last-bit flip where the fp32 sum of squares, added in
    another order, lands on the other side of a 16-bit rounding boundary."""
    from kiln.codegen.rope import qk_norm_rope

    qk, q_w, k_w, positions, inv_freq = _site(2, 11, q_heads, k_heads, d, dtype, seed=q_heads * d)
    args = (qk, q_w, k_w, q_heads * d, 1e-6, positions, inv_freq)
    got, unfused, ref = qk_norm_rope(*args), _unfused(*args), qk_norm_rope_ref(*args)
    assert got.dtype == dtype and got.is_contiguous()
    differ = got != unfused
    assert differ.float().mean().item() <= 0.005, f"{differ.sum().item()} of {got.numel()} elements differ"
    ulp = torch.finfo(dtype).eps * unfused.float().abs().clamp(min=1.0)
    assert ((got.float() - unfused.float()).abs() <= ulp).all()
    # The interpreter truncates fp32 -> bf16 where the reference rounds to nearest: a few bf16 steps.
    tol = 4e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_qk_norm_rope_in_place_on_the_fused_projection():
    from kiln.codegen.rope import qk_norm_rope

    g = torch.Generator().manual_seed(4)
    q_heads, k_heads, d = 3, 1, 32
    qkv = torch.randn(2, 5, (q_heads + 2 * k_heads) * d, generator=g)
    qk = qkv[..., : (q_heads + k_heads) * d]
    q_w, k_w = torch.rand(d, generator=g), torch.rand(d, generator=g) + 1
    positions, inv_freq = torch.arange(5).expand(2, 5), llama3_inv_freq(d)
    args = (qk, q_w, k_w, q_heads * d, 1e-6, positions, inv_freq)
    want, v = qk_norm_rope_ref(*args), qkv[..., (q_heads + k_heads) * d :].clone()
    assert qk_norm_rope(*args, out=qk) is qk
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[..., (q_heads + k_heads) * d :], v, rtol=0, atol=0)


def test_qk_norm_rope_rejects_bad_inputs():
    from kiln.codegen.rope import qk_norm_rope

    qk, pos, inv_freq = torch.randn(1, 3, 4 * 16), torch.zeros(1, 3, dtype=torch.int64), torch.ones(8)
    w = torch.ones(16)
    with pytest.raises(CodegenError, match="k_weight has 8 features"):
        qk_norm_rope(qk, w, torch.ones(8), 32, 1e-6, pos, inv_freq)
    with pytest.raises(CodegenError, match="q_features = 24"):
        qk_norm_rope(qk, w, w, 24, 1e-6, pos, inv_freq)
    with pytest.raises(CodegenError, match="q_features = 80"):
        qk_norm_rope(qk, w, w, 80, 1e-6, pos, inv_freq)
    with pytest.raises(CodegenError, match="qk has 64 features"):
        qk_norm_rope(qk, w, w, 32, 1e-6, pos, torch.ones(24))
    with pytest.raises(CodegenError, match="out has shape"):
        qk_norm_rope(qk, w, w, 32, 1e-6, pos, inv_freq, out=torch.empty(1, 3, 48))
