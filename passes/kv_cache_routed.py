"""The routed KV cache's part of the kv_cache pass (passes/kv_cache.py, whose docstring says what it emits): which
attentions belong to a routed layer's compact body (routed_attention), and per routing node its attentions'
kiln::mod_kv_slots and the kiln::mod_narrow that cuts the compact tensors to the routed rows on large steps
(routed_slots, NARROW_MIN_ROWS, NARROW_BUCKET)."""

from __future__ import annotations

import operator

import torch
from torch import fx

import kiln.ir.ops_mod  # noqa: F401  (registers kiln::mod_route, kiln::mod_gather and kiln::mod_scatter, matched here)
import kiln.ir.ops_mod_step  # noqa: F401  (registers kiln::mod_kv_slots and kiln::mod_narrow)
from kiln.passes._graph import is_call
from kiln.step import ROUTED_KV_CACHE

kiln_ops = torch.ops.kiln
_ROUTING = (kiln_ops.mod_route.default, kiln_ops.mod_gather.default)
# kiln::mod_kv_slots' outputs in order: a routed layer's own values of the paged op's step tensors (by name), then
# which flat rows it routed.
SLOT_OUTPUTS = ("slot_mapping", "block_tables", "context_lens", "query_start_loc", "routed")
# A routed layer's body runs on its routed rows (kiln::mod_narrow) on steps of at least NARROW_MIN_ROWS flat rows,
# at the price of one device -> host read of the routed count per routed layer. 256 is about where a GEMM turns
# compute-bound on a GPU (an H100's bf16 FLOP/s over its bandwidth is ~300 rows): below it the linears take about
# as long as reading their weights, whatever the rows, while the read stalls the launch queue. Decode steps stay
# on the padded path. NARROW_BUCKET rounds the rows up (a multiple of the GEMM tiles; shapes that vary less).
# Tests lower both to force the narrowed path on small steps.
NARROW_MIN_ROWS = 256
NARROW_BUCKET = 64


def routed_attention(graph: fx.Graph, attn: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each attention of a routed layer's compact body -> its routing node (mod_route / mod_gather)."""
    owner: dict[fx.Node, fx.Node] = {}
    attn_set = set(attn)
    for routing in graph.nodes:
        if not (is_call(routing, _ROUTING[0]) or is_call(routing, _ROUTING[1])):
            continue
        xs_at = 3 if is_call(routing, _ROUTING[0]) else 2
        todo = [u for u in routing.users if u.target is operator.getitem and u.args[1] == xs_at]
        seen: set[fx.Node] = set()
        while todo:  # the body: what the compact rows reach before the scatter back into the residual stream
            n = todo.pop()
            if n in seen or is_call(n, kiln_ops.mod_scatter.default):
                continue
            seen.add(n)
            if n in attn_set:
                owner[n] = routing
            todo += list(n.users)
    return owner


def _routing_outputs(graph: fx.Graph, routing: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(index, count) of a routing node, adding their getitems when the graph dropped them."""
    base = 1 if is_call(routing, _ROUTING[0]) else 0
    found = {u.args[1]: u for u in routing.users if u.target is operator.getitem}
    out = []
    for i in (base, base + 1):
        if i not in found:
            with graph.inserting_after(routing):
                found[i] = graph.call_function(operator.getitem, (routing, i))
        out.append(found[i])
    return out[0], out[1]


def routed_slots(graph: fx.Graph, owner: dict[fx.Node, fx.Node], routed: list[fx.Node],
                  inputs: dict[str, fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Per routed attention, its mod_kv_slots outputs (SLOT_OUTPUTS, slot_mapping narrowed). Each routing node
    gets, right after its getitems, its attentions' mod_kv_slots and one kiln::mod_narrow, whose outputs then
    replace index, xs, xpos and the slot mappings everywhere but in those two."""
    out: dict[fx.Node, list[fx.Node]] = {}
    routings = set(owner.values())
    for routing in [n for n in graph.nodes if n in routings]:
        index, count = _routing_outputs(graph, routing)
        items = {u.args[1]: u for u in routing.users if u.target is operator.getitem}
        base = 3 if is_call(routing, _ROUTING[0]) else 2  # xs, then xpos (absent when the body reads no position)
        compact = [index] + [items[i] for i in (base, base + 1) if i in items]
        order = {n: i for i, n in enumerate(graph.nodes)}
        attns = [n for n in routed if owner[n] is routing]
        prefix = routing.name.removesuffix("_mod_route").removesuffix("_mod_gather")
        with graph.inserting_before(max(items.values(), key=order.__getitem__).next):
            slots = []
            for node in attns:
                call = graph.create_node("call_function", kiln_ops.mod_kv_slots.default, (
                    index, count, inputs["query_start_loc"], inputs["routed_lens"], inputs["routed_block_tables"],
                    inputs[ROUTED_KV_CACHE], routed.index(node)), name=f"{node.name}_routed_slots")
                out[node] = [graph.create_node("call_function", operator.getitem, (call, i),
                                               name=f"{node.name}_{what}") for i, what in enumerate(SLOT_OUTPUTS)]
                slots.append(call)
            compact += [out[node][0] for node in attns]
            narrow = graph.create_node("call_function", kiln_ops.mod_narrow.default,
                                       (count, compact, NARROW_MIN_ROWS, NARROW_BUCKET), name=f"{prefix}_mod_narrow")
            cut = [graph.create_node("call_function", operator.getitem, (narrow, i), name=f"{old.name}_narrow")
                   for i, old in enumerate(compact)]
        keep = {narrow, *slots}
        for old, new in zip(compact, cut, strict=True):
            old.replace_all_uses_with(new, delete_user_cb=lambda u, keep=keep: u not in keep)
        for j, node in enumerate(attns):
            out[node][0] = cut[len(compact) - len(attns) + j]
    return out
