"""The norm kernels (codegen/templates/norm.py.j2) against kiln's reference rms_norm / layer_norm."""

import pytest
import torch

from kiln.errors import CodegenError
from kiln.ir import ops

ROWS = {1: (1, 1), 17: (1, 17), 100: (4, 25)}  # rows -> [B, T]


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("rows", [1, 17, 100])
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norm_matches_reference(kind, rows, d, residual):
    from kiln.codegen.norm import layer_norm, rms_norm

    torch.manual_seed(rows * 1000 + d)
    x = torch.randn(*ROWS[rows], d) * 2 + 0.5
    w = torch.randn(d)
    b = torch.randn(d)
    r = torch.randn_like(x) if residual else None
    out, r_out = _poisoned(x), _poisoned(x)
    kw = {"out": out, "residual_out": r_out if residual else None}
    if kind == "rms_norm":
        got = rms_norm(x, w, 1e-5, r, **kw)
        ref = ops.rms_norm(x + r if residual else x, w, 1e-5)
    else:
        got = layer_norm(x, w, b, 1e-5, r, **kw)
        ref = ops.layer_norm(x + r if residual else x, w, b, 1e-5)
    if residual:
        got, new_residual = got
        assert new_residual is r_out
        torch.testing.assert_close(new_residual, x + r, rtol=0, atol=0)
    assert got is out
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_layer_norm_without_bias_and_strided_rows():
    from kiln.codegen.norm import layer_norm

    torch.manual_seed(1)
    wide = torch.randn(3, 5, 2 * 96)
    x = wide[..., :96]  # rows 192 apart: a view, no copy
    w = torch.randn(96)
    got = layer_norm(x, w, None, 1e-6)
    torch.testing.assert_close(got, ops.layer_norm(x, w, torch.zeros(96), 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_bf16_close():
    from kiln.codegen.norm import rms_norm

    torch.manual_seed(2)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(64, dtype=torch.bfloat16)
    got, new_r = rms_norm(x, w, 1e-5, r)
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one bf16 step.
    torch.testing.assert_close(new_r, x + r, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, ops.rms_norm(x + r, w, 1e-5), rtol=2e-2, atol=2e-2)


def test_norm_rejects_bad_inputs():
    from kiln.codegen.norm import layer_norm, rms_norm

    x = torch.randn(2, 3, 64)
    with pytest.raises(CodegenError, match="weight"):
        rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(CodegenError, match="x has dtype"):
        rms_norm(x.to(torch.int32), torch.randn(64), 1e-5)
    with pytest.raises(CodegenError, match="residual"):
        rms_norm(x, torch.randn(64), 1e-5, torch.randn(2, 4, 64))
    with pytest.raises(CodegenError, match="bias"):
        layer_norm(x, torch.randn(64), torch.randn(63), 1e-5)
    with pytest.raises(CodegenError, match="contiguous last dim"):
        rms_norm(x.transpose(1, 2), torch.randn(3), 1e-5)
    with pytest.raises(CodegenError, match="out"):
        rms_norm(x, torch.randn(64), 1e-5, out=torch.empty(2, 3, 65))


@pytest.mark.parametrize(("heads", "d"), [(1, 40), (3, 24), (5, 16), (7, 96)])
@pytest.mark.parametrize("rows", [1, 17])
def test_head_rms_norm_matches_reference_on_strided_heads(heads, d, rows):
    """Qwen3's q/k norm: each head of a row normalized with one shared weight, x a piece of a fused projection."""
    from kiln.codegen.norm import head_rms_norm

    torch.manual_seed(rows * 100 + heads * d)
    b, t = ROWS[rows]
    fused = torch.randn(b, t, (2 * heads + 1) * d) * 3 + 0.5
    x = fused[..., heads * d : 2 * heads * d]  # the middle piece: rows (2 * heads + 1) * d apart, offset
    w = torch.randn(d)
    out = _poisoned(x.contiguous())
    got = head_rms_norm(x, w, 1e-6, out=out)
    assert got is out
    per_head = torch.stack([ops.rms_norm(x[..., h * d : (h + 1) * d], w, 1e-6) for h in range(heads)], -2)
    torch.testing.assert_close(got, per_head.reshape(x.shape), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ops.head_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_head_rms_norm_rejects_partial_heads():
    from kiln.codegen.norm import head_rms_norm

    with pytest.raises(CodegenError, match="whole number"):
        head_rms_norm(torch.randn(2, 3, 40), torch.randn(16), 1e-6)
