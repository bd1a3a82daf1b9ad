"""Normalization: a Dynamo FX graph (torch IR) -> the same graph with the patterns kiln knows replaced by kiln ops.

Why the torch-level graph Dynamo hands over, not aten from aot_autograd / make_fx: at this level
`scaled_dot_product_attention`, `linear`, `layer_norm`, `silu`, `gelu` are single calls whatever the device,
and every node carries a FakeTensor (`meta["example_value"]`) with its (possibly symbolic) shape and dtype.
In aten, sdpa is already dispatched to a device-specific kernel (`_scaled_dot_product_flash_attention_for_cpu`,
`_efficient_attention`, ...) and linear / matmul are decomposed into view + mm + expand chains, so the same
model would need different patterns on CPU and CUDA. The cost of the torch level is surface variety (methods,
functions and operators for one op; `.to` / `.float` / `.type` for one cast): `canon` maps each to one name.

How it matches: one forward walk over the nodes keeps a small abstract state per node ("this is x cast to
fp32", "this is the flat tensor src viewed as [B, H, T, D]", "this is q * cos", ...; see kiln.dynamo.rules).
When a state completes a pattern (RMSNorm, LayerNorm, rotate-half RoPE, attention via sdpa or
matmul/softmax/matmul with repeat_kv / expand+reshape GQA, SiLU*mul, GELU incl. the tanh formula, linear)
and its shapes and dtypes fit the kernel, a kiln op is inserted and the torch node's uses are rewired to it
(through a view when the layouts differ: kiln works on flat [B, T, H * D]); otherwise a Rejection with the
reason is recorded and the torch nodes stay. Dead torch nodes are then removed. A node's value is only ever
replaced by an equal value, so whatever is not claimed simply runs as torch.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import guard_float, guard_or_false, statically_known_true
from torch.utils._pytree import tree_leaves

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.*)

kiln_ops = torch.ops.kiln

_FUNCS: dict[Any, str] = {
    operator.add: "add", operator.iadd: "add", torch.add: "add", operator.mul: "mul", operator.imul: "mul",
    torch.mul: "mul", operator.truediv: "div", torch.div: "div", operator.neg: "neg", torch.neg: "neg",
    operator.getitem: "getitem", torch.rsqrt: "rsqrt", torch.pow: "pow", torch.mean: "mean", torch.tanh: "tanh",
    torch.cat: "cat", torch.concat: "cat", torch.matmul: "matmul", operator.matmul: "matmul", torch.cos: "cos",
    torch.sin: "sin", torch.transpose: "transpose", torch.reshape: "reshape", torch.unsqueeze: "unsqueeze",
    torch._C._nn.linear: "linear", F.linear: "linear", F.silu: "silu", F.gelu: "gelu", F.relu: "relu",
    torch.relu: "relu", F.softmax: "softmax", torch.softmax: "softmax", F.dropout: "dropout",
    F.layer_norm: "layer_norm", torch.layer_norm: "layer_norm", F.scaled_dot_product_attention: "sdpa",
    torch._C._nn.scaled_dot_product_attention: "sdpa", torch.sym_sum: "sym_sum",
}  # fmt: skip
_METHODS: dict[str, str] = {
    "view": "reshape", "reshape": "reshape", "to": "cast", "float": "cast", "half": "cast", "bfloat16": "cast",
    "type": "cast", "contiguous": "contiguous", "clone": "contiguous", "__neg__": "neg",
    **{m: m for m in ("add", "mul", "div", "neg", "pow", "mean", "rsqrt", "tanh", "cos", "sin", "matmul",
                      "transpose", "unsqueeze", "expand", "softmax", "unflatten", "flatten", "size")},
}  # fmt: skip
# Calls whose only effect is their value: safe to drop once nothing reads them (Dynamo graphs hold a few
# side-effecting calls, e.g. torch._C._log_api_usage_once, which are never touched).
_PURE_EXTRA = {torch.arange, torch.where, torch.zeros, torch.full, torch.tensor, operator.le, operator.lt,
               operator.ge, operator.gt, operator.and_, operator.or_, torch.ops.aten.sym_size.int}  # fmt: skip


@dataclass
class Op:
    """A call in canonical form: method and function spellings share one name; args[0] is the subject."""

    name: str
    args: tuple
    kwargs: dict

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        return self.args[i] if len(self.args) > i else self.kwargs.get(key, default)


def canon(node: fx.Node) -> Op | None:
    if node.op == "call_function":
        try:
            name = _FUNCS.get(node.target)
        except TypeError:  # unhashable target
            name = None
    elif node.op == "call_method":
        name = _METHODS.get(node.target)
    else:
        return None
    return Op(name, tuple(node.args), dict(node.kwargs)) if name else None


def is_kiln(node: object, op: Any = None) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    t = node.target
    return t == op if op is not None else isinstance(t, torch._ops.OpOverload) and t.namespace == "kiln"


def val(node: object) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def tensor(node: object) -> torch.Tensor | None:
    v = val(node) if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def same(a: Any, b: Any) -> bool:
    """a == b provably (SymInts included) without adding a guard."""
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def equal_guarded(a: Any, b: Any) -> bool:
    """a == b, provably or else by a Dynamo guard when both sizes are equal in this call (then a call where they
    differ recompiles instead of reusing the claim). For sizes that only two independent inputs share, such as
    the past keys' and past values' lengths of a KV cache: Dynamo gives each its own symbol."""
    if same(a, b):
        return True
    try:
        return guard_or_false(a == b)
    except Exception:
        return False


def same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


def scalar(x: Any) -> float | None:
    """x as a Python number, or None. Under dynamic=True Dynamo passes float constants (an RMSNorm's eps, an
    attention scale) as inputs read with .item(): such a float is specialized with a guard on its value (a call
    with another value recompiles). Symbolic ints (sizes) are never specialized."""
    if isinstance(x, fx.Node) and x.op == "call_method" and x.target == "item":
        v = val(x)
        if isinstance(v, torch.SymFloat):
            try:
                return float(guard_float(v))
            except Exception:  # no hint (data-dependent): not a constant
                return None
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def site_of(node: fx.Node) -> str:
    """Where a node comes from: the innermost nn.Module path, else the source line Dynamo recorded."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = str(list(stack.values())[-1][0])
        return path.replace("L['self'].", "").replace("L['self']", "<root>")
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return trace[-2].strip() if len(trace) >= 2 else node.name


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

    def run(self, rules: Mapping[str, Callable]) -> Normalizer:
        """Apply `rules` (op name -> rule; kiln.dynamo.rules.RULES) to every node, in graph order."""
        for node in list(self.graph.nodes):
            op = canon(node)
            rule = rules.get(op.name) if op is not None else None
            if rule is not None and node.users:
                rule(self, node, op)
        self.dce()
        live = {n.name for n in self.graph.nodes}
        self.claims = [c for c in self.claims if c.node in live]
        self.gm.recompile()
        return self

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
        new = self.emit(node, getattr(kiln_ops, op).default, args, name=f"kiln_{op}")
        out = new
        if layout is not None:
            form, h, d = layout
            out = self.emit(node, "unflatten", (new, -1, (h, d)), method=True)
            self.st[out] = St("heads", new, {"form": "bthd", "H": h, "D": d})
            if form == "bhtd":
                out = self.emit(node, "transpose", (out, 1, 2), method=True)
                self.st[out] = St("heads", new, {"form": "bhtd", "H": h, "D": d})
        node.replace_all_uses_with(out)
        self.claims.append(Claim(op, new.name, node.name, site_of(node), detail))
        return new

    def replace(self, node: fx.Node, by: fx.Node) -> bool:
        """Rewire node's users to `by`, an equal value, when their strides agree too (a later .view may rely on
        them); returns whether it did."""
        a, b = tensor(node), tensor(by)
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
                if node.op not in ("call_function", "call_method") or node.users:
                    continue
                if canon(node) is not None or is_kiln(node) or node in self.created or _pure(node):
                    self.graph.erase_node(node)
                    self.st.pop(node, None)
                    changed = True


def _pure(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target == "item":  # a float constant read by a claim (see scalar)
        return True
    try:
        return node.op == "call_function" and node.target in _PURE_EXTRA
    except TypeError:
        return False
