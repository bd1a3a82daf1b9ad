"""A kiln region's fast path: its Level-1 graph with the model's weights frozen in, through the pass pipeline and
lowering, called as a plain forward.

Which region inputs are weights (parameters and buffers, not inference tensors) and their readable names, the
graph those weights are frozen into (with the FakeTensor values the passes read), and `build_region` /
`rebuild_region`, which compile it (kiln.compile.driver.compile_model) and bind it to kernels or to the kiln ops'
reference functions.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from kiln.compile.driver import compile_model
from kiln.compile.pipeline import propagate
from kiln.dynamo.fx_query import val
from kiln.ir.registry import bind_references
from kiln.passes._graph import set_param


def _hint(d: object) -> int:
    if isinstance(d, int):
        return d
    node = d.node
    return int(node.hint) if node.hint is not None else int(node.shape_env.size_hint(node.expr))


def weight_name(placeholder: str) -> str:
    """L_self_modules_model_modules_norm_parameters_weight_ -> model.norm.weight (readable dumps and fused names)."""
    name = placeholder.removeprefix("L_self_").removeprefix("l_self_").rstrip("_")
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    return name.removeprefix("modules_").replace("modules_", "")


def is_weight(node: object, example: object) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "placeholder") or not isinstance(example, torch.Tensor):
        return False
    if isinstance(example, FakeTensor):
        return False
    # An inference tensor (made under torch.inference_mode, as serving code often loads weights) has no version
    # counter to tell an in-place change by: it stays a live input, read afresh on every call.
    if example.is_inference():
        return False
    return isinstance(example, torch.nn.Parameter) or "_buffers_" in node.name


def _fast_graph(ref: fx.GraphModule, frozen: dict[int, tuple[torch.Tensor, int]], names: dict[int, str]):
    """A copy of ref with frozen inputs as parameters and example values the passes can read."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in ref.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode()
    for i, n in enumerate(placeholders):
        if i in frozen:
            set_param(gm, names[i], frozen[i][0])
            env[n] = gm.graph.get_attr(names[i])
        else:
            env[n] = gm.graph.placeholder(n.name)
            v = val(n)
            with mode:  # concrete hint shapes: passes read head dims; kernels stay shape-generic over B and T
                env[n].meta["val"] = torch.empty([_hint(d) for d in v.shape], dtype=v.dtype, device=v.device)
    for n in ref.graph.nodes:
        if n.op == "output":
            gm.graph.output(fx.node.map_arg(n.args[0], env.__getitem__))
        elif n.op != "placeholder":
            env[n] = gm.graph.node_copy(n, env.__getitem__)
            env[n].meta.pop("val", None)  # Dynamo's symbolic values; refilled from the concrete inputs below
    gm.recompile()
    # Passes read meta["val"] on every node and the pipeline only refreshes it after a pass that changed the
    # graph: a region no pass touches (q projection, rope, attention) must arrive with it already filled.
    return propagate(gm)


def _flat_weights(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with every weight read as one plain attribute: a dotted get_attr (model.layers.0.mlp.weight) costs one
    nn.Module.__getattr__ per dot on every call, a plain instance attribute none (213 lookups per decode step of
    a 4-layer model before)."""
    for i, n in enumerate(gm.graph.find_nodes(op="get_attr")):
        if "." in n.target:
            flat = f"_w{i}_{n.target.replace('.', '_')}"
            object.__setattr__(gm, flat, operator.attrgetter(n.target)(gm))  # bypasses Module's registration
            n.target = flat
    gm.recompile()
    return gm


def _direct_reference(gm: fx.GraphModule) -> fx.GraphModule:
    """gm (not lowered: use_kernels off) calling each kiln op's reference function directly: the same torch code
    without torch.library's per-call wrappers (about 30 us per op, more than the op itself at small sizes)."""
    return bind_references(gm)


def build_region(
    ref: fx.GraphModule,
    frozen: dict,
    names: dict,
    use_kernels: bool | None,
    dump_dir: Path | None,
    overrides: dict[str, bool] | None,
) -> tuple[Callable, list[str], list[str]]:
    gm = _fast_graph(ref, frozen, names)
    compiled = compile_model(gm, None, use_kernels=use_kernels, dump_dir=dump_dir, overrides=overrides)
    kernels = [f"{k.template}:{k.params.get('op', k.name)}" for k in compiled.kernels]
    gm = compiled.gm if compiled.use_kernels else _direct_reference(compiled.gm)
    return _flat_weights(gm).forward, compiled.passes, kernels  # forward: no nn.Module __call__ per region call


def rebuild_region(ref: fx.GraphModule, frozen: dict, *, names: dict, use_kernels: bool | None,
             overrides: dict[str, bool] | None) -> Callable:
    return build_region(ref, frozen, names, use_kernels, None, overrides)[0]
