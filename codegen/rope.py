"""Host wrapper for the rope family (templates/rope.py.j2): rotate-half rotary embedding on flat heads."""

from __future__ import annotations

import torch

from kiln.codegen._host import cdiv, check_same_device, check_tensor, launch, next_power_of_2
from kiln.errors import CodegenError

_MAX_TILE = 4096  # elements per half-tile; more heads than fit are split over the grid's second axis


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """kiln::rope: x [B, T, H * D] (any strides), positions [B, T] int, inv_freq [D / 2] -> rotated x.

    `out` may be x itself to rotate in place, or any [B, T, H * D] tensor of x's dtype (any strides).
    """
    check_tensor(x, "x", ndim=3, unit_last_stride=False)
    check_tensor(positions, "positions", ndim=2, dtypes=(torch.int64, torch.int32), unit_last_stride=False)
    check_tensor(inv_freq, "inv_freq", ndim=1)
    if not inv_freq.is_contiguous():
        raise CodegenError("inv_freq must be contiguous; call .contiguous()")
    b, t, features = x.shape
    half = inv_freq.shape[0]
    if half == 0 or features % (2 * half):
        raise CodegenError(f"x has {features} features, not a multiple of head_dim = 2 * len(inv_freq) = {2 * half}")
    if tuple(positions.shape) != (b, t):
        raise CodegenError(f"positions has shape {tuple(positions.shape)}; expected [B, T] = {(b, t)}")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(out, "out", ndim=3, dtypes=(x.dtype,), unit_last_stride=False)
        if out.shape != x.shape:
            raise CodegenError(f"out has shape {tuple(out.shape)}; expected {tuple(x.shape)}")
    check_same_device(x=x, positions=positions, inv_freq=inv_freq, out=out)
    heads = features // (2 * half)
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, _MAX_TILE // block_half))
    consts = {"BLOCK_H": block_h, "BLOCK_HALF": block_half}
    (sxb, sxt, sxf), (spb, spt), (sob, sot, sof) = x.stride(), positions.stride(), out.stride()
    args = dict(
        x_ptr=x, pos_ptr=positions, inv_freq_ptr=inv_freq, out_ptr=out,
        stride_xb=sxb, stride_xt=sxt, stride_xf=sxf, stride_pb=spb, stride_pt=spt,
        stride_ob=sob, stride_ot=sot, stride_of=sof,
        T=t, H=heads, HALF=half,
    )  # fmt: skip
    if b * t > 0:
        launch("rope", "rope", (b * t, cdiv(heads, block_h)), args, consts, {"num_warps": 4})
    return out
