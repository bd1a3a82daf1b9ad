"""Normalization: a Dynamo FX graph (torch IR) -> the same graph with the patterns kiln knows replaced by kiln ops.

Why the torch-level graph Dynamo hands over, not aten from aot_autograd / make_fx: at this level
`scaled_dot_product_attention`, `linear`, `layer_norm`, `silu`, `gelu` are single calls whatever the device,
and every node carries a FakeTensor (`meta["example_value"]`) with its (possibly symbolic) shape and dtype.
In aten, sdpa is already dispatched to a device-specific kernel (`_scaled_dot_product_flash_attention_for_cpu`,
`_efficient_attention`, ...) and linear / matmul are decomposed into view + mm + expand chains, so the same
model would need different patterns on CPU and CUDA. The cost of the torch level is surface variety (methods,
functions and operators for one op; `.to` / `.float` / `.type` for one cast): `canon` maps each to one name
(kiln.dynamo.fx_query).

How it matches: one forward walk over the nodes keeps a small abstract state per node ("this is x cast to
fp32", "this is the flat tensor src viewed as [B, H, T, D]", "this is q * cos", ...; see kiln.dynamo.rules).
When a state completes a pattern (RMSNorm, LayerNorm, rotate-half RoPE, attention via sdpa or
matmul/softmax/matmul with repeat_kv / expand+reshape GQA, SiLU*mul, GELU incl. the tanh formula, linear)
and its shapes and dtypes fit the kernel, a kiln op is inserted and the torch node's uses are rewired to it
(through a view when the layouts differ: kiln works on flat [B, T, H * D]); otherwise a Rejection with the
reason is recorded and the torch nodes stay. Dead torch nodes are then removed. A node's value is only ever
replaced by an equal value, so whatever is not claimed simply runs as torch.

In-place ops (`h += x` unless nothing else could see h, `y[:, 0] = 0`, `.mul_`, ReLU(inplace=True)) stay torch
calls where they are, and are never dropped. The values they change are found up front (kiln.dynamo.mutation's
`mutated`: the written tensors and whatever shares their memory, read off the storages of the example values); a
state relating such a value is dropped at the first in-place op that changes it, and a claim never reads a value,
other than its own node's inputs, across such an op. kiln.dynamo.regions then never moves a kiln op past one.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.dynamo.fx_query import canon, is_kiln, same_shape, same_strides, site_of, tensor, val
from kiln.dynamo.mutation import as_out_of_place, mutated, writes

kiln_ops = torch.ops.kiln

# Calls whose only effect is their value: safe to drop once nothing reads them (Dynamo graphs hold a few
# side-effecting calls, e.g. torch._C._log_api_usage_once, which are never touched).
_PURE_EXTRA = {torch.arange, torch.where, torch.zeros, torch.full, torch.tensor, operator.le, operator.lt,
               operator.ge, operator.gt, operator.and_, operator.or_, torch.ops.aten.sym_size.int,
               torch._sym_sqrt}  # fmt: skip


@dataclass
class St:
    """Abstract state of a node: `kind` names the partial pattern, x the tensor it is about, p the details."""

    kind: str
    x: fx.Node
    p: dict = field(default_factory=dict)


@dataclass
class Claim:
    op: str  # kiln op name
    node: str  # the kiln node
    replaced: str  # the torch node whose value it now provides
    site: str
    detail: str = ""


@dataclass
class Rejection:
    pattern: str
    node: str
    site: str
    reason: str


MaskSpec = Callable[[fx.Node], "tuple[bool, int] | str"]


def resolve(nz: Normalizer, n: object) -> object:
    """n with `same` states followed back to the node that really holds the value."""
    while isinstance(n, fx.Node) and (s := nz.st.get(n)) is not None and s.kind == "same":
        n = s.x
    return n


class Normalizer:
    """Rewrites gm (in place) with the rules it is run with (kiln.dynamo.rules); see the module docstring."""

    def __init__(self, gm: fx.GraphModule, mask_spec: MaskSpec | None = None, off: frozenset[str] = frozenset()):
        self.gm, self.graph = gm, gm.graph
        self.off = off  # kiln ops not to claim (the backend's `claims` option)
        self.st: dict[fx.Node, St] = {}
        self.claims: list[Claim] = []
        self.rejections: list[Rejection] = []
        self.masks: dict[str, tuple[bool, int]] = {}  # mask node -> the (causal, window) an attention claimed
        self.mask_spec = mask_spec
        self.created: set[fx.Node] = set()
        self.memo: dict[tuple, fx.Node] = {}
        as_out_of_place(self.graph)
        # Where each node stands (a node inserted by a claim stands where the claimed node stood), and for the
        # values that in-place ops change, where those ops stand: a state relates values as they are at one point
        # of the graph, so it is dropped at the first op that changes one of them.
        self.pos = {n: i for i, n in enumerate(self.graph.nodes)}
        self.written = mutated(self.graph)

    def run(self, rules: Mapping[str, Callable]) -> Normalizer:
        """Apply `rules` (op name -> rule; kiln.dynamo.rules.RULES) to every node, in graph order."""
        for node in list(self.graph.nodes):
            if writes(node):
                self._forget(self.pos[node])
            op = canon(node)
            rule = rules.get(op.name) if op is not None else None
            if rule is not None and node.users:
                rule(self, node, op)
        self.dce()
        live = {n.name for n in self.graph.nodes}
        self.claims = [c for c in self.claims if c.node in live]
        self.gm.recompile()
        return self

    def _forget(self, at: int) -> None:
        """Drop the states about, or referring to, a value that the in-place op at position `at` changes."""

        def hit(s: object) -> bool:
            if isinstance(s, St):
                return hit(s.x) or hit(list(s.p.values()))
            if isinstance(s, (list, tuple)):
                return any(hit(v) for v in s)
            return isinstance(s, fx.Node) and at in self.written.get(s, ())

        self.st = {n: s for n, s in self.st.items() if not (hit(n) or hit(s))}

    def changed_between(self, n: fx.Node, at: fx.Node) -> bool:
        """Whether an in-place op between n's definition and `at` may change n's value."""
        lo, hi = self.pos.get(n, -1), self.pos[at]
        return any(lo < w < hi for w in self.written.get(n, ()))

    # ---- editing ----------------------------------------------------------------------------------------

    def emit(
        self,
        before: fx.Node,
        target: Any,
        args: tuple,
        *,
        method: bool = False,
        name: str | None = None,
        after: bool = False,
    ) -> fx.Node:
        """Insert a call (function, or method when `method`) next to `before` and fill its example value."""
        ctx = self.graph.inserting_after(before) if after else self.graph.inserting_before(before)
        with ctx:
            new = self.graph.create_node("call_method" if method else "call_function", target, args, name=name)
        vals = fx.node.map_arg(args, val)
        # The mode of the example values (not detect_fake_mode: the tracing context holds a different one).
        mode = next((v.fake_mode for v in tree_leaves(vals) if isinstance(v, FakeTensor)), None)
        with mode if mode is not None else contextlib.nullcontext():
            new.meta["example_value"] = getattr(vals[0], target)(*vals[1:]) if method else target(*vals)
        if "nn_module_stack" in before.meta:
            new.meta["nn_module_stack"] = before.meta["nn_module_stack"]
        self.created.add(new)
        self.pos[new] = self.pos[before]
        return new

    def flat(self, x: fx.Node, form: str, before: fx.Node) -> fx.Node:
        """x (a [B, H, T, D] "bhtd" or [B, T, H, D] "bthd" tensor) as flat [B, T, H * D]: its source when x is
        a view of one, else a torch copy in front of `before`."""
        s = self.st.get(x)
        if s is not None and s.kind == "heads" and s.p["form"] == form:
            return s.x
        if form == "bhtd":
            x = self.emit(before, "transpose", (x, 1, 2), method=True)
        return self.emit(before, "flatten", (x, -2), method=True)

    def claim(
        self, node: fx.Node, op: str, args: tuple, *, layout: tuple[str, int, int] | None = None, detail: str = ""
    ) -> fx.Node:
        """Insert kiln::<op>(args) before node and rewire node's users to it (through the [B, T, H, D] or
        [B, H, T, D] view of its flat output when layout = (form, H, D)); node itself when claims of op are off."""
        if op in self.off:
            self.reject(node, op, f"claims of {op} are switched off (option claims)")
            return node
        # The kiln op reads its inputs where `node` stands: a value changed in place may only be read there when
        # node itself read it (then both read it at the same point); one reached through a state may not.
        reads = [a for a in tree_leaves(list(args)) if isinstance(a, fx.Node)]
        if any(a not in node.all_input_nodes and self.changed_between(a, node) for a in reads):
            self.reject(node, op, "an input is changed in place between where it is computed and where it is read")
            return node
        new = self.emit(node, getattr(kiln_ops, op).default, args, name=f"kiln_{op}")
        out, made, forms = new, [new], ["flat"]
        if layout is not None:
            form, h, d = layout
            out = self.emit(node, "unflatten", (new, -1, (h, d)), method=True)
            made.append(out)
            forms.append("bthd")
            if form == "bhtd":
                out = self.emit(node, "transpose", (out, 1, 2), method=True)
                made.append(out)
                forms.append("bhtd")
        # The users may rely on the replaced op's strides (a .view; Dynamo's stride guards on a returned KV cache,
        # which recompile on every mismatch): give them those, copying only when the layouts differ.
        copy = self.restride(out, node)
        if copy is None:
            strides = tuple(tensor(node).stride())
            self.reject(node, op, f"kiln's output cannot be given the strides of torch's output {strides}")
            return node  # the inserted nodes are unused: dce removes them
        if copy is not out:
            out = copy
            made.append(out)
            forms.append(forms[-1])
        if node in self.written:  # the in-place ops that wrote node now write the kiln output (through its views)
            self.written.update(dict.fromkeys(made, self.written[node]))
        for view, form in zip(made[1:], forms[1:], strict=True):
            self.st[view] = (
                St("heads", new, {"form": form, "H": layout[1], "D": layout[2]}) if layout else St("same", new)
            )
        node.replace_all_uses_with(out)
        self.claims.append(Claim(op, new.name, node.name, site_of(node), detail))
        return new

    def restride(self, out: fx.Node, node: fx.Node) -> fx.Node | None:
        """out (equal to node's value) with node's strides: out itself when they already agree, else a copy of it
        made contiguous, or contiguous in node's memory order (static strides); None when neither gives them.
        The strides of size-1 dims are not compared: no view depends on them, and .contiguous() leaves them."""
        want, have = tensor(node), tensor(out)
        if want is None or have is None or same_strides(want, have):
            return out
        fix = self.emit(node, "contiguous", (out,), method=True)
        if same_strides(want, tensor(fix)):
            return fix
        strides = want.stride()
        if not all(isinstance(s, int) for s in (*strides, *want.shape)):
            return None
        order = sorted(range(want.dim()), key=lambda i: -strides[i])  # outermost dim first (stable for ties)
        inverse = tuple(sorted(range(want.dim()), key=order.__getitem__))
        fix = self.emit(node, "permute", (out, *order), method=True)
        fix = self.emit(node, "contiguous", (fix,), method=True)
        fix = self.emit(node, "permute", (fix, *inverse), method=True)
        return fix if same_strides(want, tensor(fix)) else None

    def replace(self, node: fx.Node, by: fx.Node) -> bool:
        """Rewire node's users to `by`, an equal value, when their strides agree too (a later .view may rely on
        them); returns whether it did."""
        a, b = tensor(node), tensor(by)
        if node in self.written or by in self.written:  # the two are equal only until one is written
            return False
        if a is None or b is None or a.dtype != b.dtype or not same_shape(a.shape, b.shape):
            return False
        if not same_shape(a.stride(), b.stride()):
            return False
        node.replace_all_uses_with(by)
        return True

    def reject(self, node: fx.Node, pattern: str, reason: str) -> None:
        self.rejections.append(Rejection(pattern, node.name, site_of(node), reason))

    def dce(self) -> None:
        changed = True
        while changed:
            changed = False
            for node in reversed(list(self.graph.nodes)):
                if node.op not in ("call_function", "call_method") or node.users or writes(node):
                    continue
                if canon(node) is not None or is_kiln(node) or node in self.created or _pure(node):
                    self.graph.erase_node(node)
                    self.st.pop(node, None)
                    changed = True


def _pure(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target == "item":  # a float constant read by a claim (see fx_query.scalar)
        return True
    try:
        return node.op == "call_function" and node.target in _PURE_EXTRA
    except TypeError:
        return False
