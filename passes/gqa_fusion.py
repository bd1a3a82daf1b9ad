"""gqa_fusion: one GEMM for the q/k/v projections of an attention site and one for gate/up of a gated MLP.

Matches:
- kiln::attention (or kiln::flash_attention) whose q, k and v arguments are kiln::linear nodes, each
  optionally behind a kiln::rope and a kiln::head_rms_norm (the q/k norm, before rope), all three reading the
  same input x, (each may have other readers too), with weights (and biases, if any) read by get_attr;
- kiln::gated_act whose gate and up arguments are kiln::linear nodes on one input, likewise.
Emits: one kiln::linear over the concatenated weight (a new parameter `<site>.qkv.weight` or
`<site>.gate_up.weight`; the old ones are deleted once nothing reads them), biases concatenated with zeros
for the missing ones when at least one projection has a bias, then aten.split_with_sizes on the last dim
and one getitem per projection feeding what the old linears fed (head_rms_norm, rope, attention, gated_act).
Repeat-kv patterns: none here. Spec-built graphs are GQA-native (kiln::attention takes the head counts and
flat k/v with num_kv_heads heads), so there is no expand/reshape/repeat_interleave to remove; the
torch.compile normalizer is what maps Dynamo's repeat_kv + sdpa onto kiln::attention, and this pass then
applies to its output unchanged.
Requires: nothing.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import kiln.ir.ops  # noqa: F401  (registers kiln::attention, which this pass matches)
import kiln.ir.ops_level2  # noqa: F401  (registers kiln::flash_attention, which it also matches)
from kiln.passes._graph import attr_tensor, erase_attr_if_unused, is_call, rename, set_param, unique_attr_name
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln
_ATTENTION = (kiln_ops.attention.default, kiln_ops.flash_attention.default)


def _projection(arg: object) -> fx.Node | None:
    """The kiln::linear behind an attention input, looking through one rope, then one head_rms_norm (a q/k norm);
    None if it is not one."""
    node = arg
    if is_call(node, kiln_ops.rope.default):
        node = node.args[0]
    if is_call(node, kiln_ops.head_rms_norm.default):
        node = node.args[0]
    return node if is_call(node, kiln_ops.linear.default) else None


def _fusable(gm: fx.GraphModule, linears: list[fx.Node | None]) -> bool:
    if any(n is None for n in linears) or len(set(linears)) != len(linears):
        return False
    x = linears[0].args[0]
    for n in linears:
        w, b = n.args[1], n.args[2] if len(n.args) > 2 else None
        # Other readers of a projection (e.g. the KV-cache update in a Dynamo graph) are fine: every use of the
        # old linear is rewired to its piece of the split, which holds the same values.
        if n.args[0] is not x or n.kwargs:
            return False
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return False
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
            return False
    # One GEMM needs one input width and one dtype (always so in spec-built graphs; a guard for hand-made ones).
    weights = [attr_tensor(gm, n.args[1]) for n in linears]
    return len({(w.shape[1:], w.dtype, w.device) for w in weights}) == 1


def _fused_name(weight: fx.Node, suffix: str) -> str:
    parts = str(weight.target).split(".")
    prefix = ".".join(parts[:-2]) if len(parts) >= 3 else weight.name
    return f"{prefix}.{suffix}"


def _fuse(gm: fx.GraphModule, linears: list[fx.Node], suffix: str) -> None:
    graph = gm.graph
    weights = [attr_tensor(gm, n.args[1]) for n in linears]
    bias_nodes = [n.args[2] if len(n.args) > 2 else None for n in linears]
    sizes = [w.shape[0] for w in weights]
    base = _fused_name(linears[0].args[1], suffix)
    w_name = unique_attr_name(gm, f"{base}.weight")
    set_param(gm, w_name, torch.cat(weights, dim=0))
    b_name = None
    if any(b is not None for b in bias_nodes):
        ref = weights[0]
        biases = [
            attr_tensor(gm, b) if b is not None else torch.zeros(size, dtype=ref.dtype, device=ref.device)
            for b, size in zip(bias_nodes, sizes, strict=True)
        ]
        b_name = unique_attr_name(gm, f"{base}.bias")
        set_param(gm, b_name, torch.cat(biases, dim=0))

    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(linears, key=order.__getitem__)
    node_name = base.replace(".", "_")
    with graph.inserting_before(anchor):
        w = graph.get_attr(w_name)
        b = graph.get_attr(b_name) if b_name is not None else None
        fused = graph.create_node(
            "call_function", kiln_ops.linear.default, (linears[0].args[0], w, b), name=node_name
        )
        split = graph.create_node(
            "call_function", torch.ops.aten.split_with_sizes.default, (fused, sizes, -1), name=f"{node_name}_split"
        )
        parts = [graph.create_node("call_function", operator.getitem, (split, i)) for i in range(len(linears))]
    for old, new in zip(linears, parts, strict=True):
        old.replace_all_uses_with(new)
    for old, new in zip(linears, parts, strict=True):
        w_old, b_old = old.args[1], old.args[2] if len(old.args) > 2 else None
        old_name = old.name
        graph.erase_node(old)
        rename(new, old_name)  # the piece keeps the projection's name: %layers_0_attn0_q = getitem(...)
        erase_attr_if_unused(gm, w_old)
        if b_old is not None:
            erase_attr_if_unused(gm, b_old)


def run(gm: fx.GraphModule) -> PassResult:
    groups: list[tuple[list[fx.Node], str]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _ATTENTION:
            linears = [_projection(a) for a in node.args[:3]]
            if _fusable(gm, linears):
                groups.append((linears, "qkv"))
        elif node.target == kiln_ops.gated_act.default:
            linears = [a if is_call(a, kiln_ops.linear.default) else None for a in node.args[:2]]
            if _fusable(gm, linears):
                groups.append((linears, "gate_up"))
    for linears, suffix in groups:
        _fuse(gm, linears, suffix)
    return PassResult(gm, modified=bool(groups))


PASS = Pass(name="gqa_fusion", run=run, doc=__doc__ or "")
