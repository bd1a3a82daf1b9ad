"""self_draft: the self drafter's graph, the target's first L layers followed by its own final norm and head.

Matches: a Level-1 graph (frontend output) whose layer nodes carry the frontend's names, `layers_{i}_...`
(get_attr nodes of a layer's weights included), with more than L layers.
Emits: the same graph without the nodes of layers L and above; what read the last layer's output (the final norm,
or the lm_head when final_norm = false) reads layer L-1's output instead, i.e. what layer L read. The weights of
the dropped layers leave this GraphModule; the ones kept are the same tensor objects as before.
Requires: nothing; it runs on the Level-1 graph before any other pass. It is not in the step pipeline: the pass
cuts a second model out of the target, which kiln.speculation compiles with the target's own pipeline (as its own
step model). Run it on a copy (`self_draft_graph`), since it edits the graph it is given. For the same reason the
module defines no `PASS`: the pass needs L, and named in a pipeline list it would cut the target itself.
"""

from __future__ import annotations

import re

from torch import fx

from kiln.errors import PassError
from kiln.ir.attrs import get_tensor
from kiln.passes._graph import erase_attr_if_unused
from kiln.passes.base import Pass, PassResult

_LAYER = re.compile(r"layers_(\d+)_")


def layer_of(node: fx.Node) -> int | None:
    """The layer a node belongs to by its frontend name, or None for the embedding, the head and the inputs."""
    m = _LAYER.match(node.name)
    return int(m.group(1)) if m else None


def run(gm: fx.GraphModule, layers: int) -> PassResult:
    if layers < 1:
        raise PassError(f"self_draft: layers = {layers}; the self drafter needs at least one layer")
    graph = gm.graph
    found = {i for n in graph.nodes if (i := layer_of(n)) is not None}
    if not found:
        raise PassError("self_draft: the graph has no nodes named layers_{i}_...; run it on the frontend's "
                        "Level-1 graph (kiln.ir.frontend.build_graph), before any other pass")
    total = max(found) + 1
    if layers > total:
        raise PassError(f"self_draft: layers = {layers} but the model has {total}; the self drafter uses fewer "
                        f"layers than its target")
    if layers == total:
        return PassResult(gm, False)
    dropped = [n for n in graph.nodes if (i := layer_of(n)) is not None and i >= layers]
    gone = set(dropped)
    # Layer L's input: the one value its nodes read from outside the dropped layers (not a weight or an input).
    feeds = {a for n in dropped if layer_of(n) == layers for a in n.all_input_nodes
             if a not in gone and a.op not in ("get_attr", "placeholder")}
    if len(feeds) != 1:
        raise PassError(f"self_draft: layer {layers} reads {len(feeds)} values from the layers before it, expected "
                        "one (the residual stream x); is this the frontend's Level-1 graph?")
    (x,) = feeds
    for n in dropped:  # the head reads the last layer's output: it reads layer L's input instead
        for user in list(n.users):
            if user not in gone:
                user.replace_input_with(n, x)
    for n in reversed(dropped):
        if n.op == "get_attr":
            continue
        graph.erase_node(n)
    for n in dropped:
        if n.op == "get_attr":
            erase_attr_if_unused(gm, n)
    return PassResult(gm, True)


def make_pass(layers: int) -> Pass:
    """The pass keeping the first `layers` layers."""
    return Pass(name="self_draft", run=lambda gm: run(gm, layers), doc=__doc__ or "")


def self_draft_graph(gm: fx.GraphModule, layers: int) -> fx.GraphModule:
    """A new GraphModule of the first `layers` layers, the final norm and the head of Level-1 graph `gm`, which is
    left as it was; the two share every weight they both use (the same tensors, nothing copied)."""
    new_graph = fx.Graph()
    out = new_graph.graph_copy(gm.graph, {})  # node.meta is copied (shallow): the FakeTensor values carry over
    new_graph.output(out)
    draft = fx.GraphModule(gm, new_graph, class_name=f"{type(gm).__name__}_self{layers}")  # attrs by reference
    for name, _ in gm.named_buffers():  # GraphModule re-registers every buffer as persistent; keep gm's choice
        owner_name, _, leaf = name.rpartition(".")
        if leaf in gm.get_submodule(owner_name)._non_persistent_buffers_set and get_tensor(draft, name) is not None:
            draft.get_submodule(owner_name)._non_persistent_buffers_set.add(leaf)
    draft = run(draft, layers).gm
    draft.graph.lint()
    draft.recompile()
    return draft

