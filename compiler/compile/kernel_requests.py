"""Which kernels a lowered graph needs (kiln.compile.lowering.lower's output), found without running any.

`kernel_requests` interprets the graph on FakeTensors inside codegen's `recording` dry run, so the wrappers
compute their launch parameters (the constexprs that pick a kernel instance) exactly as they will at run time,
and launch nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.codegen._host import recording


@dataclass
class KernelRequest:
    """One kernel instance (as codegen's cache keys it) and the graph nodes that launch it."""

    template: str
    name: str
    params: dict[str, Any]
    nodes: list[str] = field(default_factory=list)  # "%node: op(inputs) -> outputs" lines for headers


def _describe(node: fx.Node, args: tuple, result: Any) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(fmt(x) for x in v) + ")"
        return repr(v)

    return f"%{node.name}: {node.meta.get('kiln_op', node.target)}({', '.join(fmt(a) for a in args)}) -> {fmt(result)}"


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device):
        super().__init__(gm)
        self.mode, self.device = mode, device
        self.requests: dict[Any, KernelRequest] = {}
        self.seen: list[KernelRequest] = []  # requests made by the node being run

    def fetch_attr(self, target: str):
        t = super().fetch_attr(target)
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def run_node(self, n: fx.Node):
        self.seen = []
        result = super().run_node(n)
        for req in self.seen:
            line = _describe(n, tuple(self.map_nodes_to_values(n.args, n)), result)
            if line not in req.nodes:
                req.nodes.append(line)
        return result

    def record(self, template: str, name: str, args: Any, **params: Any) -> None:
        key = (template, name, repr(sorted(params.items())))  # params are plain dicts of ints/bools/strs
        req = self.requests.setdefault(key, KernelRequest(template, name, params))
        self.seen.append(req)


def kernel_requests(gm: fx.GraphModule) -> list[KernelRequest]:
    """The distinct kernels a lowered graph launches for its example input shapes (placeholders' meta['val'])."""
    ref = next(iter(gm.parameters()), None)
    # Record on the target device when it is a GPU (wrappers may ask it for its capability), else on meta.
    device = ref.device if ref is not None and ref.device.type == "cuda" else torch.device("meta")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [
            torch.empty_strided(n.meta["val"].shape, n.meta["val"].stride(), dtype=n.meta["val"].dtype, device=device)
            if isinstance(n.meta["val"], torch.Tensor)
            else n.meta["val"]  # host-side scalars pass through (the step graph's max_query_len, ...)
            for n in gm.graph.nodes
            if n.op == "placeholder"
        ]
    rec = _Recorder(gm, mode, device)
    with recording(rec.record), mode:
        rec.run(*inputs)
    return list(rec.requests.values())
