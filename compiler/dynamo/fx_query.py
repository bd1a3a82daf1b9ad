"""Queries on the nodes of a Dynamo FX graph: what a call is (`canon`: one name for the method, function and
operator spellings of an op), what it holds (its example value), and what can be proved about sizes and strides
without adding a guard (`same`) or by adding one (`equal_guarded`, `scalar`).

Read-only helpers shared by the normalizer (kiln.dynamo.normalize), its rules and claims, the in-place analysis
(kiln.dynamo.mutation), regions and the backend's report; none of them changes the graph.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_float, guard_or_false, statically_known_true
from torch.utils._sympy.symbol import SymT, symbol_is_type

_FUNCS: dict[Any, str] = {
    operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul", operator.truediv: "div",
    torch.div: "div", operator.neg: "neg", torch.neg: "neg",
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
    "type": "cast", "contiguous": "contiguous", "clone": "clone", "__neg__": "neg",
    **{m: m for m in ("add", "mul", "div", "neg", "pow", "mean", "rsqrt", "tanh", "cos", "sin", "matmul",
                      "transpose", "unsqueeze", "expand", "permute", "softmax", "unflatten", "flatten", "size")},
}  # fmt: skip


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


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b (of one shape) provably lay their elements out alike: equal strides except where a dim has size 1."""
    if a.dim() != b.dim():
        return False
    return all(same(n, 1) or same(x, y) for n, x, y in zip(a.shape, a.stride(), b.stride(), strict=True))


def scalar(x: Any) -> float | None:
    """x as a Python number, or None. Under dynamic=True Dynamo passes float constants (an RMSNorm's eps, an
    attention scale, math.pi in HF's tanh-GELU) as inputs read with .item(), and arithmetic on them stays in the
    graph (sqrt(2 / pi)): such a float, computed from float inputs only, is specialized with a guard on its value
    (a call with another value recompiles). Anything that involves a size (a SymInt) is never specialized."""
    if isinstance(x, fx.Node):
        v = val(x)
        if not isinstance(v, torch.SymFloat):
            return None
        symbols = v.node.expr.free_symbols
        if not all(symbol_is_type(s, SymT.FLOAT) for s in symbols):
            return None
        try:
            return float(guard_float(v))
        except Exception:  # no hint (data-dependent): not a constant
            return None
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_ROOT = re.compile(r"^L\['\w+'\](\[\d+\])*\.?")


def site_of(node: fx.Node) -> str:
    """Where a node comes from: the innermost nn.Module path, else the source line Dynamo recorded."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = str(list(stack.values())[-1][0])
        # Dynamo names the module by its source: L['self'], or L['args'][0] when the compiled forward takes the
        # module through *args (transformers >= 5.24 wraps forward so): the path is what follows
        return _ROOT.sub("", path) or "<root>"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return trace[-2].strip() if len(trace) >= 2 else node.name
