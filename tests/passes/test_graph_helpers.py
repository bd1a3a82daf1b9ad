"""passes/_graph.py: deleting a tensor by dotted name removes it and the submodules it leaves empty, no more."""

from __future__ import annotations

import torch
from torch import fx

from kiln.ir.attrs import get_tensor, set_tensor
from kiln.passes._graph import delete_attr, erase_attr_if_unused

NAMES = ("layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.1.mlp.up.weight", "norm.weight")


def _module(graph: fx.Graph | None = None) -> fx.GraphModule:
    """A graph module holding NAMES as parameters and layers.1.mlp.up.scale as a buffer."""
    root = torch.nn.Module()
    for name in NAMES:
        set_tensor(root, name, torch.ones(2))
    set_tensor(root, "layers.1.mlp.up.scale", torch.ones(1), param=False)
    if graph is None:  # GraphModule copies the tensors its graph reads: read them all
        graph = fx.Graph()
        graph.output(tuple(graph.get_attr(n) for n in (*NAMES, "layers.1.mlp.up.scale")))
    return fx.GraphModule(root, graph)


def test_delete_attr_prunes_the_submodules_left_empty():
    gm = _module()
    delete_attr(gm, "layers.0.attn.q.weight")
    assert get_tensor(gm, "layers.0.attn.q.weight") is None and not hasattr(gm.get_submodule("layers.0.attn"), "q")
    assert get_tensor(gm, "layers.0.attn.k.weight") is not None  # a sibling keeps attn alive
    delete_attr(gm, "layers.0.attn.k.weight")
    assert not hasattr(gm.layers, "0") and hasattr(gm.layers, "1")  # layers.0 emptied all the way up, layers kept
    delete_attr(gm, "layers.1.mlp.up.weight")
    assert get_tensor(gm, "layers.1.mlp.up.scale") is not None  # a buffer keeps its module
    delete_attr(gm, "layers.1.mlp.up.scale")
    assert not hasattr(gm, "layers") and get_tensor(gm, "norm.weight") is not None
    delete_attr(gm, "norm.weight")
    assert not list(gm.named_parameters()) and not list(gm.named_buffers()) and not list(gm.children())


def test_erase_attr_if_unused_keeps_a_tensor_another_node_reads():
    graph = fx.Graph()
    a, b = graph.get_attr("norm.weight"), graph.get_attr("norm.weight")
    graph.output(b)
    gm = _module(graph)
    erase_attr_if_unused(gm, a)
    assert a not in gm.graph.nodes and get_tensor(gm, "norm.weight") is not None  # b still reads it
    erase_attr_if_unused(gm, b)  # b has a user (the output): nothing happens
    assert b in gm.graph.nodes and get_tensor(gm, "norm.weight") is not None
    gm.graph.output_node().args = (None,)
    erase_attr_if_unused(gm, b)  # the last reader gone: the node and the tensor with it, and the emptied module
    assert get_tensor(gm, "norm.weight") is None and not hasattr(gm, "norm")
