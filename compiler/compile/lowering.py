"""Lowering: Level-1/Level-2 kiln nodes -> calls of the generated-kernel host wrappers (kiln.codegen).

One table maps each op to a small function with the op's own signature that calls the codegen wrapper; the
lowered graph's nodes call those functions, so it is still a readable fx graph (`format_graph` prints them
as e.g. `k_add_rms_norm(...)`). Dense GEMMs (kiln::linear) and embedding gathers stay on torch (cuBLAS on
GPU). Tile configs come from the flash_attention node's arguments (set by flash_tiling); a plain
kiln::attention (flash_tiling disabled) gets codegen's default tile at run time. Which kernels a lowered graph
needs is found by kiln.compile.kernel_requests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

import kiln.ir.ops_level2  # noqa: F401  (registers the Level-2 ops)
import kiln.ir.ops_mod  # noqa: F401  (registers the Mixture-of-Depths ops)
import kiln.ir.ops_mod_step  # noqa: F401  (registers kiln::mod_kv_slots and kiln::mod_narrow)
import kiln.ir.ops_paged  # noqa: F401  (registers kiln::paged_attention)
import kiln.ir.ops_quant  # noqa: F401  (registers the quantized linears and embedding)
import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify)
from kiln import env
from kiln.codegen import act, flash_attn, mod, norm, paged, quant, rope, spec_verify, tiles
from kiln.codegen._host import BoundKernels
from kiln.errors import CodegenError
from kiln.ir.ops_mod import mod_rows
from kiln.ir.ops_mod_step import check_compact, narrow_compact, narrow_rows
from kiln.ir.signatures import ATTENTION, FLASH_ATTENTION, PAGED_ATTENTION, QK_NORM_ROPE
from kiln.quant.formats import dequantize_parts

kiln_ops = torch.ops.kiln


def _dense(t: torch.Tensor) -> torch.Tensor:
    # Elementwise kernels take flat contiguous buffers; gate/up pieces of a fused projection are row-strided.
    return t if t.is_contiguous() else t.contiguous()


def k_embedding(weight, ids):
    return F.embedding(ids, weight)


def k_linear(x, weight, bias):
    return F.linear(x, weight, bias)


def k_add(a, b):
    return torch.add(a, b)


def k_rms_norm(x, weight, eps):
    return norm.rms_norm(x, weight, eps)


def k_head_rms_norm(x, weight, eps):
    return norm.head_rms_norm(x, weight, eps)


def k_layer_norm(x, weight, bias, eps):
    return norm.layer_norm(x, weight, bias, eps)


def k_add_rms_norm(x, residual, weight, eps):
    return norm.rms_norm(x, weight, eps, residual=residual)


def k_add_layer_norm(x, residual, weight, bias, eps):
    return norm.layer_norm(x, weight, bias, eps, residual=residual)


def k_rope(x, positions, inv_freq):
    return rope.rope(x, positions, inv_freq)


QK_NORM_ROPE.implements(rope.qk_norm_rope)  # codegen may not import kiln.ir: its wrapper is checked here


@QK_NORM_ROPE.implements
def k_qk_norm_rope(qk, q_weight, k_weight, q_features, eps, positions, inv_freq):
    return rope.qk_norm_rope(*QK_NORM_ROPE.values(locals()))


def k_gated_act(gate, up, kind):
    return act.gated_act(_dense(gate), _dense(up), kind)


def k_act(x, kind):
    return act.act(_dense(x), kind)


# The attention calls have their op's signature (kiln.ir.signatures, checked when defined) and pass it on by
# name: codegen may not import kiln.ir, so its wrappers are checked against the same table here, at import.
ATTENTION.implements(flash_attn.flash_attention, extra=("tile",))
PAGED_ATTENTION.implements(paged.paged_attention)


@ATTENTION.implements
def k_attention(q, k, v, num_heads, num_kv_heads, causal, window, scale):
    return flash_attn.flash_attention(*ATTENTION.values(locals()))


# A node's tile arguments are constants: each distinct tile is built once, not on every launch.
_tile = functools.cache(tiles.TileConfig)


@FLASH_ATTENTION.implements
def k_flash_attention(q, k, v, num_heads, num_kv_heads, causal, window, scale, block_m, block_n, num_warps,
                      num_stages):  # fmt: skip
    tile = _tile(block_m, block_n, num_warps, num_stages)
    return flash_attn.flash_attention(*ATTENTION.values(locals()), tile=tile)


@PAGED_ATTENTION.implements(extra=("tile",))
def k_paged_attention(q, k, v, kv_cache, layer, slot_mapping, block_tables, context_lens, query_start_loc,
                      max_query_len, max_context_len, num_heads, num_kv_heads, causal, window, scale, kv_scales,
                      tile=None):  # fmt: skip
    # tile: (block_m, block_n, warps, stages) of a spec's fixed flash tile (compile_step pins it), else the default.
    fixed = _tile(*tile) if tile is not None else None
    return paged.paged_attention(*PAGED_ATTENTION.values(locals()), tile=fixed)


def k_linear_w8(x, qweight, scales, bias):
    return quant.linear_w8(x, qweight, scales, bias)


def k_linear_w4(x, qweight, scales, zeros, group, bias):
    return quant.linear_w4(x, qweight, scales, zeros, group, bias)


def k_embedding_q(qweight, scales, zeros, ids, bits, group, dtype):
    # A gather of a few rows then their dequantization: torch, like the unquantized embedding.
    z = zeros[ids] if zeros is not None else None
    return dequantize_parts(qweight[ids], scales[ids], z, bits, group).to(dtype)


def k_spec_verify(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise):
    return spec_verify.spec_verify(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise)


def k_mod_route(x, positions, weight, bias, threshold):
    return mod.mod_route(x, positions, weight, bias, threshold)


def k_mod_gather(x, positions, mask, capacity):
    return mod.mod_gather(x, positions, mask, mod_rows(capacity, x.shape[1]))


def k_mod_scatter(x, ys, r, index, count):
    return mod.mod_scatter(x, ys, r, index, count)


# Mixture-of-Depths ops that stay on torch: the router of the gather forms, the predictor (two small GEMMs), the
# top-k and threshold masks, and the dense-masked layer (routed_attention, mod_combine) when mod_routing is off.
def k_mod_router(x, weight, bias):
    return torch.ops.kiln.mod_router.default(x, weight, bias)


def k_mod_predictor(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    return torch.ops.kiln.mod_predictor.default(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)


def k_mod_topk_mask(score, capacity):
    return torch.ops.kiln.mod_topk_mask.default(score, capacity)


def k_mod_threshold_mask(score, threshold):
    return torch.ops.kiln.mod_threshold_mask.default(score, threshold)


def k_routed_attention(q, k, v, routed, num_heads, num_kv_heads, causal, window, scale):
    return torch.ops.kiln.routed_attention.default(q, k, v, routed, num_heads, num_kv_heads, causal, window, scale)


def k_mod_combine(x, y, r, mask):
    return torch.ops.kiln.mod_combine.default(x, y, r, mask)


def k_mod_narrow(count, compact, min_rows, bucket):
    # Views, not copies (the op's reference copies: a custom op may not alias its inputs); the padded path returns
    # the tensors themselves. Under kernel_requests' FakeTensors the count is data: the rows stay the bound.
    if isinstance(count, FakeTensor) or not compact:
        return list(compact)
    return narrow_compact(compact, narrow_rows(count, check_compact(compact), min_rows, bucket))


def k_mod_kv_slots(index, count, query_start_loc, routed_lens, routed_block_tables, routed_kv_cache, layer):
    # The routed KV cache's slots, lengths and offsets: a few small integer tensor ops, left to torch.
    return torch.ops.kiln.mod_kv_slots.default(index, count, query_start_loc, routed_lens, routed_block_tables,
                                               routed_kv_cache, layer)


KERNEL_TABLE: dict[Any, Callable] = {
    kiln_ops.embedding.default: k_embedding,
    kiln_ops.linear.default: k_linear,
    kiln_ops.add.default: k_add,
    kiln_ops.rms_norm.default: k_rms_norm,
    kiln_ops.head_rms_norm.default: k_head_rms_norm,
    kiln_ops.layer_norm.default: k_layer_norm,
    kiln_ops.add_rms_norm.default: k_add_rms_norm,
    kiln_ops.add_layer_norm.default: k_add_layer_norm,
    kiln_ops.rope.default: k_rope,
    kiln_ops.qk_norm_rope.default: k_qk_norm_rope,
    kiln_ops.gated_act.default: k_gated_act,
    kiln_ops.act.default: k_act,
    kiln_ops.attention.default: k_attention,
    kiln_ops.flash_attention.default: k_flash_attention,
    kiln_ops.paged_attention.default: k_paged_attention,
    kiln_ops.linear_w8.default: k_linear_w8,
    kiln_ops.linear_w4.default: k_linear_w4,
    kiln_ops.embedding_q.default: k_embedding_q,
    kiln_ops.spec_verify.default: k_spec_verify,
    kiln_ops.mod_route.default: k_mod_route,
    kiln_ops.mod_gather.default: k_mod_gather,
    kiln_ops.mod_scatter.default: k_mod_scatter,
    kiln_ops.mod_router.default: k_mod_router,
    kiln_ops.mod_predictor.default: k_mod_predictor,
    kiln_ops.mod_topk_mask.default: k_mod_topk_mask,
    kiln_ops.mod_threshold_mask.default: k_mod_threshold_mask,
    kiln_ops.routed_attention.default: k_routed_attention,
    kiln_ops.mod_combine.default: k_mod_combine,
    kiln_ops.mod_kv_slots.default: k_mod_kv_slots,
    kiln_ops.mod_narrow.default: k_mod_narrow,
}


def lower(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every kiln op by its kernel call (in place), each bound to its own kernels (codegen's BoundKernels:
    tensor checks only under KILN_DEBUG, read now); a kiln op without a lowering is a CodegenError."""
    checked = env.debug()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "kiln":
            continue
        fn = KERNEL_TABLE.get(node.target)
        if fn is None:
            raise CodegenError(
                f"no kernel lowering for {node.target} (node %{node.name}); add it to lowering.KERNEL_TABLE"
            )
        node.meta["kiln_op"] = str(node.target)
        node.target = BoundKernels(fn, checked=checked)
    gm.recompile()
    return gm
