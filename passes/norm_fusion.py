"""norm_fusion: a residual add and the norm that reads it become one op.

Matches: kiln::add(a, b) whose result is the input x of a kiln::rms_norm or kiln::layer_norm (the first such
norm in graph order when there are several). The sum may have other users (the residual stream that a later
add reads) or none besides the norm (the final norm).
Emits: kiln::add_rms_norm(a, b, weight, eps) or kiln::add_layer_norm(a, b, weight, bias, eps), returning
(normed, sum); getitem 0 replaces the norm and getitem 1 (only when something else reads the sum) replaces
the add. The fused node sits where the add was, so every reader of the sum still comes after it.
Requires: nothing (gqa_fusion and rope_fusion do not touch adds or norms).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import kiln.ir.ops  # noqa: F401  (registers the norms this pass matches)
import kiln.ir.ops_level2  # noqa: F401  (registers the fused add + norm ops it emits)
from kiln.passes._graph import hoist_before, is_call, rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln
_FUSED = {
    kiln_ops.rms_norm.default: kiln_ops.add_rms_norm.default,
    kiln_ops.layer_norm.default: kiln_ops.add_layer_norm.default,
}


def _first_norm_user(add: fx.Node) -> fx.Node | None:
    norms = [u for u in add.users if u.op == "call_function" and u.target in _FUSED and u.args[0] is add]
    if not norms:
        return None
    order = {n: i for i, n in enumerate(add.graph.nodes)}
    return min(norms, key=order.__getitem__)


def _fuse(gm: fx.GraphModule, add: fx.Node, norm: fx.Node) -> None:
    graph = gm.graph
    a, b = add.args
    norm_params = norm.args[1:]  # (weight, eps) or (weight, bias, eps)
    hoist_before(add, [p for p in norm_params if isinstance(p, fx.Node)])
    with graph.inserting_after(add):
        fused = graph.create_node(
            "call_function", _FUSED[norm.target], (a, b, *norm_params), name=f"{add.name}_{norm.name}"
        )
    with graph.inserting_after(fused):
        normed = graph.create_node("call_function", operator.getitem, (fused, 0))
    norm_name, add_name = norm.name, add.name
    norm.replace_all_uses_with(normed)
    graph.erase_node(norm)
    rename(normed, norm_name)
    total = None
    if len(add.users) > 0:
        with graph.inserting_after(normed):
            total = graph.create_node("call_function", operator.getitem, (fused, 1))
        add.replace_all_uses_with(total)
    graph.erase_node(add)
    if total is not None:
        rename(total, add_name)


def run(gm: fx.GraphModule) -> PassResult:
    pairs = []
    for node in gm.graph.nodes:
        if is_call(node, kiln_ops.add.default):
            norm = _first_norm_user(node)
            if norm is not None:
                pairs.append((node, norm))
    for add, norm in pairs:
        _fuse(gm, add, norm)
    return PassResult(gm, modified=bool(pairs))


PASS = Pass(name="norm_fusion", run=run, doc=__doc__ or "")
