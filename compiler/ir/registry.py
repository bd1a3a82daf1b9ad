"""Every kiln op's reference implementation as a plain Python function, next to the registered op.

`@kiln_op("kiln::name")` registers the op exactly as torch.library.custom_op does and keeps the undecorated
function. The op itself has no autograd formula (kernels replace it after lowering); calling the plain function
instead runs the same torch code with autograd, which is how kiln.train differentiates a Level-1 graph without
writing a backward for any op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import fx
from torch.library import custom_op

REFERENCE: dict[str, Callable] = {}  # "kiln::name" -> the reference function


def kiln_op(name: str, *, mutates_args: Iterable[str] | str = (), schema: str | None = None
            ) -> Callable[[Callable], object]:
    def register(fn: Callable) -> object:
        assert name not in REFERENCE, f"{name} is registered twice"
        REFERENCE[name] = fn
        return custom_op(name, mutates_args=mutates_args, schema=schema)(fn)

    return register


def reference(op: str) -> Callable:
    """The reference function of kiln op `op` ("add" or "kiln::add"). References that build on other kiln ops call
    them through this, not through torch.ops: the same code without the dispatcher's per-call wrappers (see
    bind_references), and differentiable (kiln.train) since no custom op sits in between."""
    return REFERENCE[op if "::" in op else f"kiln::{op}"]


def bind_references(gm: fx.GraphModule) -> fx.GraphModule:
    """gm (in place) calling each kiln op's reference function directly, for graphs that run without kernels:
    the same torch code without torch.library's per-call wrappers (the autograd and in-place layers, default
    filling: tens of microseconds per op, more than many ops themselves at decode sizes). Each bound node keeps
    its op's name in meta["kiln_op"], as lowering's kernel calls do (op_name reads either)."""
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.name in REFERENCE:
            n.meta["kiln_op"] = str(n.target)
            n.target = REFERENCE[schema.name]
    gm.recompile()
    return gm


def unbind_references(gm: fx.GraphModule) -> fx.GraphModule:
    """Undo bind_references (in place): the ops back as the dispatcher's, whose fake kernels passes propagate (a
    step graph compiled twice, e.g. a loaded model served by two engines, runs the passes over the bound one)."""
    changed = False
    for n in gm.graph.nodes:
        name = n.meta.get("kiln_op")
        if name is None:
            continue
        ns, op, overload = name.split(".")
        if n.target is REFERENCE.get(f"{ns}::{op}"):
            n.target = getattr(getattr(getattr(torch.ops, ns), op), overload)
            del n.meta["kiln_op"]
            changed = True
    if changed:
        gm.recompile()
    return gm


def op_name(n: fx.Node) -> str:
    """The kiln op a node calls ("kiln.paged_attention.default"), bound (to a kernel or a reference) or not."""
    return n.meta.get("kiln_op", str(n.target))
