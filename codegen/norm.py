"""Host wrappers for the norm family (templates/norm.py.j2): rms_norm and layer_norm, optionally fused
with the residual add that precedes them (out = norm(x + residual), plus the sum for the next layer), and
head_rms_norm (rms_norm over each head of flat heads: Qwen3's q/k norms), the same kernel with one program per
row and head."""

from __future__ import annotations

import torch

from kiln.codegen._host import check_out, check_same_device, check_tensor, launch, next_power_of_2, rows_view
from kiln.errors import CodegenError


def _num_warps(block_d: int) -> int:
    return 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16


def _norm(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    per_head: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    check_tensor(x, "x")
    check_tensor(weight, "weight", ndim=1)
    d = weight.shape[0] if per_head else x.shape[-1]  # the features one program normalizes
    if per_head and (d == 0 or x.shape[-1] % d):
        raise CodegenError(f"weight has {d} features, and x's {x.shape[-1]} are not a whole number of such heads")
    if not per_head and weight.shape[0] != d:
        raise CodegenError(f"weight has {weight.shape[0]} features but x has {d}")
    heads = x.shape[-1] // d if per_head else 1
    if bias is not None:
        check_tensor(bias, "bias", ndim=1)
        if bias.shape[0] != d:
            raise CodegenError(f"bias has {bias.shape[0]} features but x has {d}")
    if residual is not None:
        check_tensor(residual, "residual", dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise CodegenError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)
    out = check_out(out, x)
    x2, o2 = rows_view(x, "x"), rows_view(out, "out")
    if residual is not None:
        residual_out = check_out(residual_out, x, "residual_out")
        r2, ro2 = rows_view(residual, "residual"), rows_view(residual_out, "residual_out")
    else:
        r2, ro2 = x2, o2  # unused placeholders: HAS_RESIDUAL=False compiles the loads away
    block_d = next_power_of_2(d)
    consts = {
        "BLOCK_D": block_d,
        "IS_RMS": op != "layer_norm",
        "HAS_RESIDUAL": residual is not None,
        "HAS_BIAS": bias is not None,
    }
    args = dict(
        x_ptr=x2, res_ptr=r2, w_ptr=weight, b_ptr=bias if bias is not None else weight, out_ptr=o2, res_out_ptr=ro2,
        stride_x=x2.stride(0), stride_res=r2.stride(0), stride_out=o2.stride(0), stride_res_out=ro2.stride(0),
        D=d, eps=float(eps),
    )  # fmt: skip
    if x2.shape[0] > 0:
        launch("norm", op, (x2.shape[0], heads), args, consts, {"num_warps": _num_warps(block_d)})
    return out if residual is None else (out, residual_out)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kiln::rms_norm over the last dim of x [..., D].

    With `residual`, returns (rms_norm(x + residual), x + residual): the fused pre-norm residual add.
    """
    return _norm("rms_norm", x, weight, None, eps, residual, out, residual_out)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """kiln::head_rms_norm: rms_norm over each head of x [..., H * D] with weight [D] shared by the heads. x may be
    a row-strided view (a piece of the fused qkv projection); out is contiguous."""
    return _norm("head_rms_norm", x, weight, None, eps, None, out, None, per_head=True)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kiln::layer_norm over the last dim of x [..., D] (bias may be None); `residual` as in rms_norm."""
    return _norm("layer_norm", x, weight, bias, eps, residual, out, residual_out)
