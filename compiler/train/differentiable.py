"""Run a Level-1 graph with autograd: every kiln op through its plain-torch reference (kiln.ir.registry).

The registered ops have no backward (after lowering they are kernels); their reference functions are ordinary
torch code, so interpreting the graph with them trains exactly the model the compiler serves, with no second
copy of its semantics. Parameters stay the GraphModule's own: set requires_grad on the ones to train.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from kiln.ir.registry import REFERENCE


class Differentiable(fx.Interpreter):
    """forward(tokens [B, T], positions [B, T]) -> logits [B, T, V], differentiable in the graph's parameters.

    `tap`, when given, is called with (node, output) after every kiln op: how a caller reads intermediate values
    (router scores, a layer's input: `self.env[node.args[0]]`) without changing the graph.
    """

    def __init__(self, gm: fx.GraphModule, tap: Callable[[fx.Node, torch.Tensor], None] | None = None):
        super().__init__(gm)
        self.tap = tap
        self.current_node: fx.Node | None = None

    def call_function(self, target, args, kwargs):  # noqa: ANN001, ANN201 (fx.Interpreter's signature)
        schema = getattr(target, "_schema", None)
        name = schema.name if schema is not None else ""
        if not name.startswith("kiln::"):
            return super().call_function(target, args, kwargs)
        fn = REFERENCE.get(name)
        if fn is None:
            raise NotImplementedError(f"{name} has no reference function in kiln.ir.registry")
        out = fn(*args, **kwargs)
        if self.tap is not None:
            self.tap(self.current_node, out)
        return out

    def run_node(self, n: fx.Node):  # noqa: ANN201
        self.current_node = n
        return super().run_node(n)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            b, t = tokens.shape
            positions = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
        return self.run(tokens, positions)
