"""A readable text form of a kiln fx graph: one line per node with its shape and dtype.

Used by `kiln compile --dump-ir` (and the per-pass dumps). fx's own `print(gm.graph)` shows no shapes and
spells ops as `torch.ops.kiln.rms_norm.default`; this prints what a person reviewing a pass wants to see.
"""

from __future__ import annotations

import torch
from torch import fx

_DTYPE = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
}


def _type_of(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, (int, float, bool)):  # plain scalar inputs (the step graph's host-side lengths)
        return type(val).__name__
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(d) for d in val.shape)
        return f"{_DTYPE.get(val.dtype, str(val.dtype))}[{dims}]"
    return "?"


def _arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "(" + ", ".join(_arg(x) for x in a) + ")"
    if isinstance(a, float):
        return repr(a)
    return str(a)


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::")[-1]
        return f"{ns}.{name}" if target._overloadname == "default" else f"{ns}.{name}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def format_graph(gm: fx.GraphModule, title: str = "") -> str:
    lines = [f"# {title}"] if title else []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"input %{node.name}: {_type_of(node)}")
        elif node.op == "get_attr":
            lines.append(f"%{node.name}: {_type_of(node)} = weight {node.target}")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
        else:
            args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"%{node.name}: {_type_of(node)} = {_op_name(node)}({', '.join(args)})")
    return "\n".join(lines) + "\n"


def weight_bytes(gm: fx.GraphModule) -> int:
    """Bytes of every parameter and buffer, counted once even when shared (tied embeddings)."""
    seen: dict[int, int] = {}
    for t in list(gm.parameters()) + list(gm.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
