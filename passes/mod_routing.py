"""mod_routing: each Mixture-of-Depths routed layer, from the dense-masked form to a compact batch of its routed rows.

Matches: kiln::mod_combine(x, y, r, mask) (the frontend's routed layer, kiln.ir.ops_mod) where mask is a
kiln::mod_threshold_mask or kiln::mod_topk_mask node, the layer body is every node between x and y (descendants
of x that y depends on, the routing nodes excluded), nothing outside the body reads a body node but the combine,
the body reads only x, the `positions` input, weights, constants and (its routed_attention nodes) the mask, and
the routing nodes come before the body in graph order (as the frontend emits them).
Emits, per routed layer:
- causal threshold form (mask = mod_threshold_mask(r, threshold), r = mod_router(x, w, b)): one
  kiln::mod_route(x, positions, w, b, threshold) -> (r, index, count, xs, xpos): score, selection and gather in one
  kernel; the router and mask nodes go away;
- training (top-k) and predictor forms: kiln::mod_gather(x, positions, mask, capacity) -> (index, count, xs, xpos);
- the body rewired onto the compact batch: x -> xs, positions -> xpos (rope keeps the original positions), every
  kiln::routed_attention(q, k, v, mask, ...) -> kiln::attention(q, k, v, ...) among the compact rows;
- kiln::mod_scatter(x, y, r, index, count) in place of the combine: the router-weighted scatter-add into the
  residual stream.

Data-dependent sizes. How many tokens the causal form routes depends on the data, and FakeTensor propagation must
still give every node a value on torch 2.11 and 2.13. We chose a static padded capacity with a count over
unbacked symbolic sizes (torch.library.get_ctx().new_dynamic_size()): those need a ShapeEnv in every FakeTensorMode
kiln makes (the pipeline's propagation, kiln.compile.kernel_requests, Dynamo regions), and every host wrapper that
branches on a row count (`if rows > 0`, grid sizes, tile choice) would raise on a data-dependent guard. So the
compact batch has C = mod_rows(capacity, T) rows: exactly the routed count in the training form (the top
ceil(capacity * T)), and T, the bound, in the causal form, with count[b] saying how many rows of sequence b are
real. Padding rows come after the real ones, so causal attention never shows them to a real row, and the scatter
ignores them. The training form thus saves the FLOPs of the unrouted tokens here; in this graph the causal form's
kernels do the padded work. The step graph (passes/kv_cache.py) cuts it back at run time: there the causal form
saves KV memory and attention work (a routed layer's cache and keys are its routed tokens only), and on a step of
at least kv_cache_routed.NARROW_MIN_ROWS rows (prefill-heavy; 256) kiln::mod_narrow reads the routed count to the host
once per routed layer and the body runs on that count rounded up to kv_cache_routed.NARROW_BUCKET rows; smaller (decode)
steps keep the padded rows, where the read would cost more than the rows. Shapes: meta["val"] everywhere (every
FakeTensor propagation, kiln.compile.kernel_requests) says C = T (the bound); at run time the body's tensors have
C' <= C rows, and every kernel and reference op downstream takes its row count from its inputs.
Non-causal attention in a routed layer is refused by spec validation, so causality always holds.
Requires: nothing; it runs first, so gqa_fusion, rope_fusion, norm_fusion, flash_tiling and quantize see the
compact body's plain kiln::attention and linears (they do not match kiln::routed_attention).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import kiln.ir.ops_mod  # noqa: F401  (registers the Mixture-of-Depths ops)
from kiln.passes._graph import hoist_before, is_call, rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln
_MASKS = (kiln_ops.mod_threshold_mask.default, kiln_ops.mod_topk_mask.default)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(n.users)
    return seen


def _match(combine: fx.Node) -> tuple[list[fx.Node], fx.Node | None] | None:
    """(the body in graph order, the positions input if the body reads it), or None when the layer does not match."""
    x, y, r, mask = combine.args
    if not (is_call(mask, _MASKS[0]) or is_call(mask, _MASKS[1])):
        return None
    routing = _ancestors(mask) | _ancestors(r)
    body = (_descendants(x) & _ancestors(y)) - routing - {x}
    if y not in body:
        return None
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    first = min(order[n] for n in body)
    if any(order[n] > first for n in routing if n.op == "call_function"):
        return None
    positions = None
    for n in body:
        if any(u not in body for u in n.users if not (n is y and u is combine)):
            return None
        for inp in n.all_input_nodes:
            if inp in body or inp is x or inp.op == "get_attr":
                continue
            if inp is mask and is_call(n, kiln_ops.routed_attention.default):
                continue
            if inp.op == "placeholder" and inp.target == "positions":
                positions = inp
                continue
            return None
    return sorted(body, key=order.__getitem__), positions


def _getitems(graph: fx.Graph, node: fx.Node, names: list[str | None]) -> list[fx.Node | None]:
    out = []
    with graph.inserting_after(node):
        for i, name in reversed(list(enumerate(names))):
            out.append(graph.create_node("call_function", operator.getitem, (node, i), name=name) if name else None)
    return out[::-1]


def _rewrite(gm: fx.GraphModule, combine: fx.Node, body: list[fx.Node], positions: fx.Node | None) -> None:
    graph = gm.graph
    x, y, r, mask = combine.args
    prefix = combine.name.removesuffix("_mod_combine")
    anchor = body[0]
    pos_name = f"{prefix}_xpos" if positions is not None else None
    score = mask.args[0]
    fused = (is_call(mask, _MASKS[0]) and mask.args[1] is not None and score is r
             and is_call(r, kiln_ops.mod_router.default) and set(r.users) == {mask, combine})
    if fused:
        _, w, b = r.args
        hoist_before(anchor, [w, b, mask.args[1]])
        with graph.inserting_before(anchor):
            node = graph.create_node("call_function", kiln_ops.mod_route.default,
                                     (x, positions if positions is not None else _positions(graph), w, b, mask.args[1]),
                                     name=f"{prefix}_mod_route")
        new_r, index, count, xs, xpos = _getitems(graph, node, [f"{prefix}_r", f"{prefix}_index", f"{prefix}_count",
                                                                f"{prefix}_xs", pos_name])
    else:
        capacity = mask.args[1] if is_call(mask, _MASKS[1]) else 1.0
        with graph.inserting_before(anchor):
            node = graph.create_node("call_function", kiln_ops.mod_gather.default,
                                     (x, positions if positions is not None else _positions(graph), mask, capacity),
                                     name=f"{prefix}_mod_gather")
        index, count, xs, xpos = _getitems(graph, node, [f"{prefix}_index", f"{prefix}_count", f"{prefix}_xs",
                                                         pos_name])
        new_r = r
    for n in body:
        n.args = tuple(xs if a is x else xpos if a is positions and positions is not None else a for a in n.args)
        if is_call(n, kiln_ops.routed_attention.default):
            q, k, v, _, *rest = n.args
            with graph.inserting_before(n):
                att = graph.create_node("call_function", kiln_ops.attention.default, (q, k, v, *rest))
            n.replace_all_uses_with(att)
            name = n.name
            graph.erase_node(n)
            rename(att, name)
    with graph.inserting_before(combine):
        scatter = graph.create_node("call_function", kiln_ops.mod_scatter.default, (x, y, new_r, index, count),
                                    name=f"{prefix}_mod_scatter")
    combine.replace_all_uses_with(scatter)
    graph.erase_node(combine)
    if fused:  # the router and the mask now live inside mod_route
        assert not mask.users, mask.users
        graph.erase_node(mask)
        graph.erase_node(r)


def _positions(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "placeholder" and n.target == "positions")


def run(gm: fx.GraphModule) -> PassResult:
    matches = []
    for node in gm.graph.nodes:
        if is_call(node, kiln_ops.mod_combine.default):
            m = _match(node)
            if m is not None:
                matches.append((node, *m))
    for combine, body, positions in matches:
        _rewrite(gm, combine, body, positions)
    return PassResult(gm, modified=bool(matches))


PASS = Pass(name="mod_routing", run=run, doc=__doc__ or "")
