"""Attention masks that are graph values: claim them only behind a cheap run-time guard.

HF builds its masks with its own mask functions (aranges, comparisons, padding from `attention_mask`), so the
values are not provable from the graph's structure. Instead: the nodes that compute a mask (its ancestors,
when they are all pure and start from graph inputs) are copied into a small graph; at compile time it runs on
Dynamo's example inputs and the mask's pattern is read off its values (causal, or causal with a sliding window
of w keys; anything else, e.g. padding or a bias, is not claimed). At run time the backend runs the same small
graph first and compares each mask with the pattern it claimed ([.., T, S] elementwise, one host sync per call
for all masks together); a call whose masks differ (padding appeared, the window grew past the example) runs
the original graph instead, so a claim is never silently wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from kiln.dynamo.mutation import mutated, writes
from kiln.ir.ops import attention_mask


def _allowed(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attend? bool, is the value a valid mask entry?) for a boolean or additive (0 / -inf / dtype min) mask."""
    if m.dtype == torch.bool:
        return m, torch.ones((), dtype=torch.bool, device=m.device)
    zero = m == 0
    return zero, (zero | (m <= torch.finfo(m.dtype).min)).all()


def infer_spec(m: torch.Tensor) -> tuple[bool, int] | str:
    """The (causal, window) of kiln::attention that this mask equals, or why there is none."""
    if not (m.dtype == torch.bool or m.dtype.is_floating_point) or m.dim() < 2:
        return f"the mask is a {m.dtype} tensor of rank {m.dim()}"
    allowed, valid = _allowed(m)
    if not bool(valid):
        return "the mask holds values other than 0 / -inf / dtype-min (an additive bias, not a pattern)"
    t, s = m.shape[-2], m.shape[-1]
    rows = allowed.reshape(-1, t, s)
    if not bool((rows == rows[0]).all()):
        return "the mask differs across batch / heads (padding)"
    a = rows[0]
    if torch.equal(a, attention_mask(t, s, True, 0, a.device)):
        return True, 0
    if bool(a.all()):
        return False, 0
    window = int(a.sum(-1).max())
    if window > 0 and torch.equal(a, attention_mask(t, s, True, window, a.device)):
        return True, window
    return "the mask is neither causal nor a causal sliding window"


def _subgraph(gm: fx.GraphModule, outputs: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[int]] | str:
    """A graph computing `outputs` from gm's inputs (and the placeholder indices it reads), or why not."""
    need, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    changed = mutated(gm.graph)
    for n in need:
        if n.op in ("call_module", "get_attr"):
            return f"the mask is computed through {n.op} {n.target}"
        if writes(n):
            return f"the mask is computed with an in-place op ({getattr(n.target, '__name__', n.target)})"
        if n in changed:  # the guard runs the mask's nodes before the graph, which would then see other values
            return f"the mask reads {n.name}, which the graph changes in place"
    graph, env, idx = fx.Graph(), {}, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in gm.graph.nodes:
        if n in need:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "placeholder":
                idx.append(placeholders.index(n))
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph), idx


class MaskOracle:
    """Reads mask patterns at compile time (MaskOracle.spec) and builds the run-time guard (MaskOracle.guard)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[object]):
        self.gm, self.inputs = gm, list(example_inputs)
        self.by_name = {n.name: n for n in gm.graph.nodes}

    def spec(self, mask: fx.Node) -> tuple[bool, int] | str:
        node = self.by_name.get(mask.name)
        if node is None:
            return "the mask is not a node of the graph Dynamo handed over"
        sub = _subgraph(self.gm, [node])
        if isinstance(sub, str):
            return sub
        gm, idx = sub
        args = [self.inputs[i] for i in idx]
        if any(isinstance(a, FakeTensor) for a in args):
            return "the example inputs are fake, so the mask cannot be read"
        # Dynamo hands int inputs it made symbolic (cache lengths) as SymInts: read them at their hints.
        args = [a.node.hint if isinstance(a, torch.SymInt) else a for a in args]
        if any(a is None for a in args):
            return "the mask depends on a size with no example value"
        with torch.no_grad():
            (value,) = gm(*args)
        return infer_spec(value)

    def guard(self, specs: dict[str, tuple[bool, int]]) -> MaskGuard:
        names = sorted(specs)
        sub = _subgraph(self.gm, [self.by_name[n] for n in names])
        assert not isinstance(sub, str), sub  # spec() built the same subgraph per mask
        return MaskGuard(sub[0], sub[1], [specs[n] for n in names])


class MaskGuard:
    """Called with the graph's inputs: do all claimed masks still have the pattern they were claimed with?"""

    def __init__(self, gm: fx.GraphModule, idx: list[int], specs: list[tuple[bool, int]]):
        self.gm, self.idx, self.specs = gm, idx, specs
        self.failures = 0

    def __call__(self, args: Sequence[object]) -> bool:
        with torch.no_grad():
            masks = self.gm(*[args[i] for i in self.idx])
            oks = []
            for m, (causal, window) in zip(masks, self.specs, strict=True):
                allowed, valid = _allowed(m)
                want = attention_mask(m.shape[-2], m.shape[-1], causal, window, m.device)
                oks.append(valid & (allowed.all() if want is None else (allowed == want).all()))
            ok = bool(torch.stack(oks).all())
        self.failures += not ok
        return ok
