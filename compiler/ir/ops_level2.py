"""kiln's Level-2 ops: fused and tiled forms that passes rewrite Level-1 ops into.

Each is a torch.library custom op whose reference implementation is written with the Level-1 references
(so a passed graph still runs on plain torch and stays checkable against the unpassed one) plus a fake
kernel for FakeTensor propagation. Lowering (kiln.compile.lowering) maps each to one generated kernel.

- kiln::flash_attention(q, k, v, H, Hkv, causal, window, scale, block_m, block_n, num_warps, num_stages):
  kiln::attention with a tile config (made by flash_tiling); its signature is kiln.ir.signatures.FLASH_ATTENTION
- kiln::add_rms_norm(x, residual, weight, eps) -> (normed, sum): rms_norm(x + residual) and the sum (norm_fusion)
- kiln::add_layer_norm(x, residual, weight, bias, eps) -> (normed, sum): likewise for layer norm (norm_fusion)
- kiln::qk_norm_rope(qk, q_weight, k_weight, q_features, eps, positions, inv_freq): the q/k norms then rope
  over the q|k slab of a fused projection (rope_fusion at a Qwen3 site); its signature is
  kiln.ir.signatures.QK_NORM_ROPE

Fused projections (gqa_fusion) need no op of their own: one kiln::linear over a concatenated weight followed
by aten.split_with_sizes.
"""

from __future__ import annotations

import torch

import kiln.ir.ops  # noqa: F401  (the Level-1 ops the references call)
from kiln.ir.registry import kiln_op, reference
from kiln.ir.signatures import ATTENTION, FLASH_ATTENTION, QK_NORM_ROPE

kiln_ops = torch.ops.kiln


@kiln_op(FLASH_ATTENTION.op, mutates_args=(), schema=FLASH_ATTENTION.schema())
@FLASH_ATTENTION.implements
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: int,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """kiln::attention computed tile by tile; the tile config changes the schedule, never the result."""
    return reference("attention")(*ATTENTION.values(locals()))


@flash_attention.register_fake
def _(q, *rest):
    return torch.empty_like(q)


@kiln_op("kiln::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the norm after it in one pass over memory."""
    s = reference("add")(x, residual)
    return reference("rms_norm")(s, weight, eps), s


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@kiln_op("kiln::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    s = reference("add")(x, residual)
    return reference("layer_norm")(s, weight, bias, eps), s


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(x)


@kiln_op(QK_NORM_ROPE.op, mutates_args=(), schema=QK_NORM_ROPE.schema())
@QK_NORM_ROPE.implements
def qk_norm_rope(
    qk: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_features: int,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """rope(head_rms_norm(q, q_weight, eps)) | rope(head_rms_norm(k, k_weight, eps)) for q = qk[..., :q_features],
    k = the rest: qk [B, T, (Hq + Hk) * D] (the adjacent q|k columns of a fused projection), weights [D]. Each
    head's norm output is rounded to qk's dtype before its rotation, as between the two unfused ops."""
    norm, rope = reference("head_rms_norm"), reference("rope")
    q, k = qk[..., :q_features], qk[..., q_features:]
    q = rope(norm(q, q_weight, eps), positions, inv_freq)
    k = rope(norm(k, k_weight, eps), positions, inv_freq)
    return torch.cat((q, k), dim=-1)


@qk_norm_rope.register_fake
def _(qk, *rest):
    return torch.empty_like(qk, memory_format=torch.contiguous_format)


LEVEL2_OPS = (
    kiln_ops.flash_attention.default,
    kiln_ops.add_rms_norm.default,
    kiln_ops.add_layer_norm.default,
    kiln_ops.qk_norm_rope.default,
)
