"""Small graph-editing helpers shared by the passes (no pass lives here)."""

from __future__ import annotations

import torch
from torch import fx

from kiln.ir.attrs import get_tensor, owner, set_tensor


def is_call(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def attr_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The tensor a get_attr node reads."""
    assert node.op == "get_attr", node
    tensor = get_tensor(gm, str(node.target))
    assert tensor is not None, node
    return tensor


def set_param(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    """Register `tensor` as a frozen parameter under a dotted `name`, creating the submodules on the way."""
    set_tensor(gm, name, tensor)


def delete_attr(gm: fx.GraphModule, name: str) -> None:
    """Delete a parameter or buffer by dotted name, then every submodule that this leaves empty."""
    mod, leaf = owner(gm, name)
    delattr(mod, leaf)
    name = name.rpartition(".")[0]
    while name:  # the submodules on the way, innermost first, as long as they are left empty
        parent, leaf = owner(gm, name)
        child = getattr(parent, leaf)
        if next(child.children(), None) is not None or child._parameters or child._buffers:
            break
        delattr(parent, leaf)
        name = name.rpartition(".")[0]


def erase_attr_if_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase a get_attr node and its tensor once nothing reads it (another get_attr may share the tensor)."""
    if node.users:
        return
    target = str(node.target)
    gm.graph.erase_node(node)
    if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
        delete_attr(gm, target)


def hoist_before(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    """Move get_attr nodes that come after `anchor` to just before it (they have no inputs, so this is safe)."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    for n in nodes:
        if isinstance(n, fx.Node) and n.op == "get_attr" and order[n] > order[anchor]:
            anchor.prepend(n)


def unique_attr_name(gm: fx.GraphModule, name: str) -> str:
    taken = {n for n, _ in gm.named_parameters()} | {n for n, _ in gm.named_buffers()}
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def rename(node: fx.Node, name: str) -> None:
    """Give `node` the name of a node the pass just erased, so dumps keep reading %layers_0_attn0_q etc.

    fx never frees a name, so Node._rename would add a suffix; when no live node holds `name` we take it
    over directly (private fx state, hence the fallbacks: at worst the name gets a suffix).
    """
    graph = node.graph
    namespace = getattr(graph, "_graph_namespace", None)
    if any(n.name == name for n in graph.nodes) or not hasattr(namespace, "_rename_object"):
        if hasattr(node, "_rename"):
            node._rename(name)
        return
    node.name = name
    namespace._rename_object(node, name)
