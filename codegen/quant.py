"""Host wrappers for the quantized linears: quant_gemv (decode, M small) and quant_gemm (prefill).

`linear_w8` / `linear_w4` have the signatures of kiln::linear_w8 / kiln::linear_w4 (kiln.ir.ops_quant) and pick
the kernel by M, the number of activation rows: up to GEMV_MAX_M rows the weight is streamed once per row
(bandwidth-bound decode), above it tiles share each dequantized weight tile across BLOCK_M rows.
"""

from __future__ import annotations

import torch

from kiln import env
from kiln.codegen._host import FLOAT_DTYPES, cdiv, check_same_device, check_tensor, launch
from kiln.errors import CodegenError

GEMV_MAX_M = 4
_GEMV_BLOCK_N, _GEMV_BLOCK_K = 8, 256  # small N tiles: enough programs to keep every SM streaming
_GEMM_BLOCK_N, _GEMM_BLOCK_K = 64, 64


def _gemm_block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    # An input may be copied (only outputs must be written in place), so any layout is accepted.
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _out(out: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor:
    shape = (*x.shape[:-1], n)
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise CodegenError(
            f"out must be a contiguous {x.dtype} tensor of shape {shape}, got {out.dtype} "
            f"{tuple(out.shape)} (contiguous={out.is_contiguous()})"
        )
    return out


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group: int,
    k: int,
    out: torch.Tensor | None,
    kernel: str | None,
) -> torch.Tensor:
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    n = qweight.shape[0]
    if x.shape[-1] != k:
        raise CodegenError(f"x has {x.shape[-1]} features but the weight takes K = {k}")
    if bias is not None:
        check_tensor(bias, "bias", ndim=1)
        if bias.shape[0] != n:
            raise CodegenError(f"bias has {bias.shape[0]} entries but the weight has N = {n} outputs")
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    out = _out(out, x, n)
    x2, o2 = _rows(x, k), out.view(-1, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out
    kernel = kernel or ("quant_gemv" if m <= GEMV_MAX_M else "quant_gemm")
    if kernel not in ("quant_gemv", "quant_gemm"):
        raise CodegenError(f"unknown quantized-linear kernel {kernel!r}; expected quant_gemv or quant_gemm")
    z = zeros if zeros is not None else scales
    b = bias if bias is not None else scales
    consts = {"BITS": bits, "GROUP": max(group, 1), "HAS_ZEROS": zeros is not None, "HAS_BIAS": bias is not None,
              "ZERO_IS_MIN": zeros is not None and zeros.is_floating_point(),
              "GROUP_SCALES8": bits == 8 and scales.dim() == 2}
    args = dict(x_ptr=x2, w_ptr=qweight, s_ptr=scales, z_ptr=z, b_ptr=b, out_ptr=o2, N=n, K=k,
                stride_xm=x2.stride(0), stride_wn=qweight.stride(0), stride_sn=scales.stride(0), stride_zn=z.stride(0),
                stride_om=o2.stride(0))  # fmt: skip
    op = f"linear_w{bits}"
    if kernel == "quant_gemv":
        consts |= {"BLOCK_N": _GEMV_BLOCK_N, "BLOCK_K": _GEMV_BLOCK_K}
        launch(kernel, op, (cdiv(n, _GEMV_BLOCK_N), m), args, consts, {"num_warps": 4})
    else:
        block_m = _gemm_block_m(m)
        # fp32 activations: exact products (tf32 would be ~1e-3 off the reference); 16-bit: the backend default.
        # Triton's CPU interpreter computes tl.dot on an in-kernel bf16/fp16 cast wrongly: it dots in fp32.
        dot_fp32 = x.dtype == torch.float32 or env.triton_interpret()
        consts |= {
            "INPUT_PRECISION": "ieee" if dot_fp32 else None,
            "DOT_FP32": dot_fp32,
            "BLOCK_M": block_m,
            "BLOCK_N": _GEMM_BLOCK_N,
            "BLOCK_K": _GEMM_BLOCK_K,
        }
        args["M"] = m
        grid = (cdiv(m, block_m), cdiv(n, _GEMM_BLOCK_N))
        launch(kernel, op, grid, args, consts, {"num_warps": 4, "num_stages": 3})
    return out


def linear_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """kiln::linear_w8: x [..., K] @ (qweight int8 [N, K] * scales [N, None]).T (+ bias) in x's dtype; 2-D scales
    [N, K / G] scale each group of G along K."""
    check_tensor(qweight, "qweight", ndim=2, dtypes=(torch.int8,))
    check_tensor(scales, "scales", dtypes=(torch.float32,))
    n, k = qweight.shape
    if scales.dim() not in (1, 2) or scales.shape[0] != n or (scales.dim() == 2 and k % scales.shape[1]):
        raise CodegenError(f"scales of shape {tuple(scales.shape)} do not fit qweight [N={n}, K={k}]: expected [N] "
                           "or [N, K / G] with G dividing K")
    group = k // scales.shape[1] if scales.dim() == 2 else 0
    return _launch(x, qweight, scales, None, bias, 8, group, k, out, kernel)


def linear_w4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """kiln::linear_w4: group-wise int4 (uint8 [N, K / 2], two codes per byte); zeros None = symmetric, uint8 =
    zero points, fp32 = per-group minimums (w = q * s + m)."""
    check_tensor(qweight, "qweight", ndim=2, dtypes=(torch.uint8,))
    check_tensor(scales, "scales", ndim=2, dtypes=(torch.float32,))
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group <= 0 or k % group or scales.shape != (n, k // group):
        raise CodegenError(
            f"int4 weight [N={n}, K={k}] with group {group} needs K a multiple of the group and "
            f"scales of shape {(n, k // group) if group > 0 and k % group == 0 else '?'}, "
            f"got scales {tuple(scales.shape)}"
        )
    if zeros is not None:
        check_tensor(zeros, "zeros", ndim=2, dtypes=(torch.uint8, torch.float32))
        if zeros.shape != scales.shape:
            raise CodegenError(f"zeros shape {tuple(zeros.shape)} differs from scales shape {tuple(scales.shape)}")
    return _launch(x, qweight, scales, zeros, bias, 4, group, k, out, kernel)
