"""Host wrappers for the rope family (templates/rope.py.j2): rotate-half rotary embedding on flat heads, and the
same kernel with each head rms-normed first (qk_norm_rope: Qwen3's q/k norms and rope in one launch)."""

from __future__ import annotations

import torch

from kiln.codegen._host import cdiv, check_same_device, check_tensor, launch, next_power_of_2
from kiln.errors import CodegenError

_MAX_TILE = 4096  # elements per half-tile; more heads than fit are split over the grid's second axis


def _check_inputs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, name: str) -> None:
    check_tensor(x, name, ndim=3, unit_last_stride=False)
    check_tensor(positions, "positions", ndim=2, dtypes=(torch.int64, torch.int32), unit_last_stride=False)
    check_tensor(inv_freq, "inv_freq", ndim=1)
    if not inv_freq.is_contiguous():
        raise CodegenError("inv_freq must be contiguous; call .contiguous()")
    b, t, features = x.shape
    half = inv_freq.shape[0]
    if half == 0 or features % (2 * half):
        raise CodegenError(
            f"{name} has {features} features, not a multiple of head_dim = 2 * len(inv_freq) = {2 * half}"
        )
    if tuple(positions.shape) != (b, t):
        raise CodegenError(f"positions has shape {tuple(positions.shape)}; expected [B, T] = {(b, t)}")


def _launch(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor, op: str, norm: dict | None
) -> None:
    """The rope kernel over x [B, T, H * D] into out; norm: the kernel's q_w_ptr, k_w_ptr, Q_HEADS and eps (NORM on)."""
    b, t, features = x.shape
    half = inv_freq.shape[0]
    heads = features // (2 * half)
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, _MAX_TILE // block_half))
    consts = {"BLOCK_H": block_h, "BLOCK_HALF": block_half, "NORM": norm is not None}
    # Without NORM the weight pointers, Q_HEADS and eps are never read: placeholders of the right kinds.
    norm = norm or dict(q_w_ptr=inv_freq, k_w_ptr=inv_freq, Q_HEADS=0, eps=0.0)
    (sxb, sxt, sxf), (spb, spt), (sob, sot, sof) = x.stride(), positions.stride(), out.stride()
    args = dict(
        x_ptr=x, pos_ptr=positions, inv_freq_ptr=inv_freq, out_ptr=out,
        stride_xb=sxb, stride_xt=sxt, stride_xf=sxf, stride_pb=spb, stride_pt=spt,
        stride_ob=sob, stride_ot=sot, stride_of=sof,
        T=t, H=heads, HALF=half, **norm,
    )  # fmt: skip
    if b * t > 0:
        launch("rope", op, (b * t, cdiv(heads, block_h)), args, consts, {"num_warps": 4})


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """kiln::rope: x [B, T, H * D] (any strides), positions [B, T] int, inv_freq [D / 2] -> rotated x.

    `out` may be x itself to rotate in place, or any [B, T, H * D] tensor of x's dtype (any strides).
    """
    _check_inputs(x, positions, inv_freq, "x")
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(out, "out", ndim=3, dtypes=(x.dtype,), unit_last_stride=False)
        if out.shape != x.shape:
            raise CodegenError(f"out has shape {tuple(out.shape)}; expected {tuple(x.shape)}")
    check_same_device(x=x, positions=positions, inv_freq=inv_freq, out=out)
    _launch(x, positions, inv_freq, out, "rope", None)
    return out


def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_features: int,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kiln::qk_norm_rope: qk [B, T, (Hq + Hk) * D] (any strides: the q|k columns of a fused projection, read in
    place), each head rms-normed with q_weight [D] (heads in the first q_features) or k_weight [D], then rotated.
    `out` may be qk itself, or any [B, T, (Hq + Hk) * D] tensor of qk's dtype; by default a new contiguous one."""
    _check_inputs(qk, positions, inv_freq, "qk")
    d = 2 * inv_freq.shape[0]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(w, name, ndim=1)
        if w.shape[0] != d:
            raise CodegenError(f"{name} has {w.shape[0]} features; expected head_dim = 2 * len(inv_freq) = {d}")
    if q_features % d or not 0 <= q_features <= qk.shape[-1]:
        raise CodegenError(
            f"q_features = {q_features} is not a whole number of heads of {d} within qk's {qk.shape[-1]} features"
        )
    if out is None:
        out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    else:
        check_tensor(out, "out", ndim=3, dtypes=(qk.dtype,), unit_last_stride=False)
        if out.shape != qk.shape:
            raise CodegenError(f"out has shape {tuple(out.shape)}; expected {tuple(qk.shape)}")
    check_same_device(qk=qk, q_weight=q_weight, k_weight=k_weight, positions=positions, inv_freq=inv_freq, out=out)
    norm = dict(q_w_ptr=q_weight, k_w_ptr=k_weight, Q_HEADS=q_features // d, eps=float(eps))
    _launch(qk, positions, inv_freq, out, "qk_norm_rope", norm)
    return out
