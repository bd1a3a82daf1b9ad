"""Host wrappers for the quantized linears: quant_gemv (decode, M small), quant_gemm (batched decode, prefill) and,
after a split-K launch of either, quant_reduce.

`linear_w8` / `linear_w4` have the signatures of kiln::linear_w8 / kiln::linear_w4 (kiln.ir.ops_quant); the
kernel, tile and split-K come from kiln.codegen.quant_tiles.choose_tile (one table, by shape, bits and device).
The weights are read in the stored forms of kiln.quant.formats (int4: GGML's 32-k block order).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kiln.codegen._host import FLOAT_DTYPES, cdiv, check_same_device, check_tensor, dot_consts, launch
from kiln.codegen.quant_tiles import GEMV_MAX_M, QuantTile, choose_tile, min_block_k
from kiln.errors import CodegenError

__all__ = ["GEMV_MAX_M", "QuantTile", "linear_w4", "linear_w8"]
_KERNELS = ("quant_gemv", "quant_gemm")
_REDUCE_BLOCK_N = 256


@lru_cache(maxsize=16)
def device_info(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a CUDA device; (1, (0, 0)) elsewhere (the CPU interpreter)."""
    if device.type != "cuda":
        return 1, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, (props.major, props.minor)


@lru_cache(maxsize=4096)
def _choose(bits: int, group: int, m: int, n: int, k: int, sm_count: int, capability: tuple, kernel: str | None):
    # choose_tile is pure in its arguments (MEASURED is fixed at import): a launch pays one dict lookup for it.
    return choose_tile(bits, group, m, n, k, sm_count=sm_count, capability=capability, kernel=kernel)


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


def _check_tile(t: QuantTile, bits: int, group: int) -> None:
    smallest = min_block_k(bits, group)
    if t.kernel not in _KERNELS:
        raise CodegenError(f"unknown quantized-linear kernel {t.kernel!r}; expected one of {_KERNELS}")
    dims = (t.block_n, t.block_k) + ((t.block_m,) if t.kernel == "quant_gemm" else ())
    if any(d < 1 or d & (d - 1) for d in dims) or t.block_k < smallest or t.split_k < 1:
        raise CodegenError(f"tile {t} is not usable: block sizes must be powers of two, block_k at least "
                           f"{smallest} for {bits}-bit weights, split_k at least 1")
    if t.kernel == "quant_gemm" and min(t.block_m, t.block_n) < 16:
        raise CodegenError(f"tile {t}: quant_gemm needs block_m and block_n of at least 16 (tl.dot)")


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
    tile: QuantTile | None,
) -> torch.Tensor:
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    n = qweight.shape[0]
    if x.shape[-1] != k:
        raise CodegenError(f"x has {x.shape[-1]} features but the weight takes K = {k}")
    if bias is not None:
        check_tensor(bias, "bias", ndim=1)
        if bias.shape[0] != n:
            raise CodegenError(f"bias has {bias.shape[0]} entries but the weight has N = {n} outputs")
    if kernel is not None and kernel not in _KERNELS:
        raise CodegenError(f"unknown quantized-linear kernel {kernel!r}; expected one of {_KERNELS}")
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    out = _out(out, x, n)
    x2, o2 = _rows(x, k), out.view(-1, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out
    group_scales8 = bits == 8 and scales.dim() == 2
    sm_count, capability = device_info(x.device)
    if tile is None:
        tile = _choose(bits, group, m, n, k, sm_count, capability, kernel)
    else:
        _check_tile(tile, bits, group)
    k_split = tile.k_split(k)
    split = cdiv(k, k_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else o2
    z = zeros if zeros is not None else scales
    b = bias if bias is not None else scales
    consts = {"BITS": bits, "GROUP": max(group, 1), "HAS_ZEROS": zeros is not None, "HAS_BIAS": bias is not None,
              "ZERO_IS_MIN": zeros is not None and zeros.is_floating_point(), "GROUP_SCALES8": group_scales8,
              "EVEN_K": k % tile.block_k == 0, "SPLIT_K": split}  # fmt: skip
    args = dict(x_ptr=x2, w_ptr=qweight, s_ptr=scales, z_ptr=z, b_ptr=b, out_ptr=o2, part_ptr=part, N=n, K=k,
                K_SPLIT=k_split, stride_xm=x2.stride(0), stride_wn=qweight.stride(0), stride_sn=scales.stride(0),
                stride_zn=z.stride(0), stride_om=o2.stride(0), stride_ps=m * n, stride_pm=n)  # fmt: skip
    op = f"linear_w{bits}"
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    if tile.kernel == "quant_gemv":
        consts |= {"BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
        launch("quant_gemv", op, (m, cdiv(n, tile.block_n), split), args, consts, options)
    else:
        consts |= {**dot_consts(x.dtype), "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
        args["M"] = m
        grid = (cdiv(m, tile.block_m), cdiv(n, tile.block_n), split)
        launch("quant_gemm", op, grid, args, consts, options)
    if split > 1:
        reduce_args = dict(part_ptr=part, b_ptr=b, out_ptr=o2, N=n, stride_ps=m * n, stride_pm=n,
                           stride_om=o2.stride(0))  # fmt: skip
        reduce_consts = {"SPLIT_K": split, "HAS_BIAS": bias is not None, "BLOCK_N": _REDUCE_BLOCK_N}
        launch("quant_reduce", op, (m, cdiv(n, _REDUCE_BLOCK_N)), reduce_args, reduce_consts, {"num_warps": 4})
    return out


def linear_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
    tile: QuantTile | None = None,
) -> torch.Tensor:
    """kiln::linear_w8: x [..., K] @ (qweight int8 [N, K] * scales [N, None]).T (+ bias) in x's dtype; 2-D scales
    [N, K / G] scale each group of G along K. kernel / tile override choose_tile (tests, bench/quant.py --sweep)."""
    check_tensor(qweight, "qweight", ndim=2, dtypes=(torch.int8,))
    check_tensor(scales, "scales", dtypes=(torch.float32,))
    n, k = qweight.shape
    if scales.dim() not in (1, 2) or scales.shape[0] != n or (scales.dim() == 2 and k % scales.shape[1]):
        raise CodegenError(f"scales of shape {tuple(scales.shape)} do not fit qweight [N={n}, K={k}]: expected [N] "
                           "or [N, K / G] with G dividing K")
    group = k // scales.shape[1] if scales.dim() == 2 else 0
    return _launch(x, qweight, scales, None, bias, 8, group, k, out, kernel, tile)


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
    tile: QuantTile | None = None,
) -> torch.Tensor:
    """kiln::linear_w4: group-wise int4 (uint8 [N, K / 2], two codes per byte in 32-k blocks); zeros None =
    symmetric, uint8 = zero points, fp32 = per-group minimums (w = q * s + m). kernel / tile: as linear_w8."""
    check_tensor(qweight, "qweight", ndim=2, dtypes=(torch.uint8,))
    check_tensor(scales, "scales", ndim=2, dtypes=(torch.float32,))
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group <= 0 or group % 32 or k % group or scales.shape != (n, k // group):
        raise CodegenError(
            f"int4 weight [N={n}, K={k}] with group {group} needs a group that is a multiple of 32 (the packing "
            "block), K a multiple of the group and "
            f"scales of shape {(n, k // group) if group > 0 and k % group == 0 else '?'}, "
            f"got scales {tuple(scales.shape)}"
        )
    if zeros is not None:
        check_tensor(zeros, "zeros", ndim=2, dtypes=(torch.uint8, torch.float32))
        if zeros.shape != scales.shape:
            raise CodegenError(f"zeros shape {tuple(zeros.shape)} differs from scales shape {tuple(scales.shape)}")
    return _launch(x, qweight, scales, zeros, bias, 4, group, k, out, kernel, tile)
