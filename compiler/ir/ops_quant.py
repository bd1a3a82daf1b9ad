"""kiln's quantized Level-2 ops (made by passes/quantize.py); stored forms as in kiln.quant.formats.

- kiln::linear_w8(x, qweight int8 [N, K], scales fp32 [N], bias?) -> [..., N]
- kiln::linear_w4(x, qweight uint8 [N, K / 2], scales fp32 [N, K / G], zeros uint8 [N, K / G]?, group, bias?)
- kiln::embedding_q(qweight, scales, zeros?, ids, bits, group, dtype): a quantized embedding table (opt-in)

The references dequantize to the activation dtype and call the Level-1 op, so a quantized graph still runs
on plain torch and is checked against a graph whose weights are the dequantized ones. Lowering maps the
linears to the generated GEMV / GEMM kernels (codegen/quant.py) and the embedding to a torch gather.
"""

from __future__ import annotations

import torch

import kiln.ir.ops  # noqa: F401  (the Level-1 ops the references call)
from kiln.ir.registry import kiln_op, reference
from kiln.quant.formats import dequantize_parts

kiln_ops = torch.ops.kiln


@kiln_op("kiln::linear_w8", mutates_args=())
def linear_w8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """kiln::linear with an int8 per-output-channel weight (W8A16)."""
    w = dequantize_parts(qweight, scales, None, 8, 0).to(x.dtype)
    return reference("linear")(x, w, bias)


@linear_w8.register_fake
def _(x, qweight, scales, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@kiln_op("kiln::linear_w4", mutates_args=())
def linear_w4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """kiln::linear with a group-wise int4 weight, two codes per byte (zeros None = symmetric)."""
    w = dequantize_parts(qweight, scales, zeros, 4, group).to(x.dtype)
    return reference("linear")(x, w, bias)


@linear_w4.register_fake
def _(x, qweight, scales, zeros, group, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@kiln_op("kiln::embedding_q", mutates_args=())
def embedding_q(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    ids: torch.Tensor,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """kiln::embedding over a quantized table: gather the rows, then dequantize only those."""
    rows = dequantize_parts(qweight[ids], scales[ids], zeros[ids] if zeros is not None else None, bits, group)
    return rows.to(dtype)


@embedding_q.register_fake
def _(qweight, scales, zeros, ids, bits, group, dtype):
    dim = qweight.shape[1] * (2 if bits == 4 else 1)
    return torch.empty((*ids.shape, dim), dtype=dtype, device=qweight.device)


QUANT_OPS = (kiln_ops.linear_w8.default, kiln_ops.linear_w4.default, kiln_ops.embedding_q.default)
