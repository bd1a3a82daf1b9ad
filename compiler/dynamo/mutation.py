"""In-place ops in a Dynamo FX graph: which nodes write which tensors (`writes`), which values those writes
change, aliases included (`mutated`), and the `h += x` / `h *= x` that can safely become out-of-place ops
(`as_out_of_place`).

Dynamo's graph keeps in-place ops as they were written: `h += x` is operator.iadd(h, x), `y[:, 0] = 0` is
operator.setitem, `y.mul_(2)` a method call, nn.ReLU(inplace=True) F.relu(..., inplace=True). Each writes the
memory of its subject and of every view of it, and the graph's order is what says which reads see the write.
kiln.dynamo.normalize drops what it knows about a value at the first op that changes it, kiln.dynamo.masks
refuses masks built from written values, and kiln.dynamo.regions never moves a kiln op past a write.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from kiln.dynamo.fx_query import same_shape, tensor, val

_INPLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift,
}  # fmt: skip
_INPLACE_DUNDERS = {f"__i{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                                          "or", "xor", "lshift", "rshift")} | {"__setitem__"}  # fmt: skip


@functools.lru_cache(maxsize=256)
def _inplace_signature(target: Any) -> inspect.Signature | None:
    """target's signature when it has an `inplace` parameter (F.relu, F.silu, F.dropout, ...), else None."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without one
        return None
    return sig if "inplace" in sig.parameters else None


def _inplace_kwarg(target: Any, args: tuple, kwargs: dict) -> bool:
    """F.relu(x, inplace=True) and its kin (the flag by keyword or by position)."""
    if kwargs.get("inplace") is True:
        return True
    try:
        sig = _inplace_signature(target)
    except TypeError:  # unhashable target
        return False
    try:
        return sig is not None and sig.bind(*args, **kwargs).arguments.get("inplace") is True
    except TypeError:
        return False


def writes(node: fx.Node) -> list[fx.Node]:
    """The tensor nodes whose memory `node` writes: an in-place op's subject, an `out=` tensor, the mutable
    arguments of an op overload; [] for a call that only returns a value."""
    if node.op not in ("call_function", "call_method"):
        return []
    args, out = node.args, node.kwargs.get("out")
    hit: list[Any] = [out] if isinstance(out, fx.Node) else list(out) if isinstance(out, (tuple, list)) else []
    t = node.target
    if node.op == "call_method":
        name = str(t)
        if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
            hit.append(args[0] if args else None)
    elif isinstance(t, torch._ops.OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                hit.append(args[i] if i < len(args) else node.kwargs.get(a.name))
    else:
        try:
            operator_write = t in _INPLACE_OPERATORS
        except TypeError:  # unhashable target
            operator_write = False
        name = getattr(t, "__name__", "")
        # torch.relu_, F.relu_, Tensor.add_ (not operator.and_ / or_: there the underscore only avoids a keyword)
        torch_inplace = name.endswith("_") and not name.startswith("_") and getattr(t, "__module__", "") != "_operator"
        if operator_write or torch_inplace or _inplace_kwarg(t, args, node.kwargs):
            hit.append(args[0] if args else node.kwargs.get("input"))
    return [a for a in hit if isinstance(a, fx.Node)]


def _storages(v: Any) -> set:
    keys = set()
    for t in tree_leaves(v):
        if isinstance(t, torch.Tensor):
            try:
                keys.add(StorageWeakRef(t.untyped_storage()))
            except Exception:  # a tensor without storage (a subclass): it has no aliases to track
                pass
    return keys


def mutated(graph: fx.Graph) -> dict[fx.Node, tuple[int, ...]]:
    """The nodes whose values some in-place op of the graph changes, each with the positions (indices in the
    graph's node order) of those ops: the written tensors and everything sharing memory with them (views both ways,
    a .contiguous() / .to() that returned its input), read off the storages of Dynamo's example values. Such a
    value depends on where in the graph it is read."""
    nodes = list(graph.nodes)
    direct: dict[fx.Node, set[int]] = {}
    by_storage: dict = {}
    for i, n in enumerate(nodes):
        for w in writes(n):
            for m in (w, n):
                direct.setdefault(m, set()).add(i)
            for key in _storages(val(w)):
                by_storage.setdefault(key, set()).add(i)
    out = {}
    for n in nodes:
        points = set(direct.get(n, ()))
        for key in _storages(val(n)):
            points |= by_storage.get(key, set())
        if points:
            out[n] = tuple(sorted(points))
    return out


def as_out_of_place(graph: fx.Graph) -> None:
    """Rewrite `h += x` / `h *= x` as h + x / h * x where nothing can see the difference: h is computed in the
    graph (not a graph input or a weight), nothing else reads it or shares its memory, and the out-of-place result
    has the same dtype, shape and strides. Such an op can then be matched like any add / mul; the others stay
    in-place calls that run as torch (never claimed, never dropped)."""
    owners: dict = {}
    for n in graph.nodes:
        for key in _storages(val(n)):
            owners.setdefault(key, set()).add(n)
    plain = {operator.iadd: operator.add, operator.imul: operator.mul}
    if any(n.op == "get_attr" and not _storages(val(n)) for n in graph.nodes):
        return  # a constant whose memory is unknown: any h might be a view of it
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in plain or len(n.args) != 2 or n.kwargs:
            continue
        h, y = n.args
        th, tn, ty = tensor(h), tensor(n), tensor(y)
        if th is None or tn is None or h.op not in ("call_function", "call_method") or set(h.users) != {n}:
            continue
        if any(owners.get(k, set()) - {h, n} for k in _storages(th)):
            continue
        same_dtype = ty.dtype == th.dtype if ty is not None else isinstance(y, (int, float))  # a Python number
        if not (th.dtype.is_floating_point and same_dtype):
            continue
        mode = th.fake_mode if isinstance(th, FakeTensor) else None
        with mode if mode is not None else contextlib.nullcontext():
            fresh = plain[n.target](th, val(y))
        same_layout = same_shape(fresh.shape, tn.shape) and same_shape(fresh.stride(), tn.stride())
        if fresh.dtype != tn.dtype or not same_layout:
            continue
        n.target = plain[n.target]
        n.meta["example_value"] = fresh
        for key in _storages(fresh):
            owners.setdefault(key, set()).add(n)
