"""Kiln regions: connected groups of claimed kiln ops, each run through the pass pipeline and lowered to kernels.

After normalization the graph mixes kiln ops and torch calls. The kiln ops are grouped into maximal regions
(torch.fx's CapabilityBasedPartitioner, which keeps the contracted graph acyclic); each region becomes a
Level-1 kiln graph (the same IR the spec frontend builds), goes through `build_pipeline` / `run_pipeline` and
`lower` like a spec file, and is called from the outer graph through one opaque custom op,
`kiln_dynamo::region(inputs, id)`. Being a custom op with a fake kernel (the region's Level-1 graph run on fake
tensors) is what lets the outer graph go to inductor unchanged while kiln regions stay kiln's.

Weights: region inputs that are the model's parameters or buffers are frozen into the region as get_attr
constants (so gqa_fusion can concatenate q/k/v and gate/up weights). Each call checks that the tensors passed
for them are still the same memory (data_ptr) at the same version counter (cheap); if a weight was replaced
(`param.data = ...` included) or updated in place, that call runs the region's Level-1 graph on the tensors
passed instead (correct, slower).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.library import custom_op

from kiln.compile.driver import compile_model
from kiln.compile.pipeline import propagate
from kiln.dynamo.fx_query import is_kiln, val
from kiln.dynamo.mutation import writes
from kiln.errors import KilnError
from kiln.ir.registry import bind_references
from kiln.passes._graph import set_param

_PREFIX = "kiln_region_"
_REGIONS: dict[int, Region] = {}
_ids = itertools.count()


def new_region_id() -> int:
    return next(_ids)


def run_region(inputs: list[torch.Tensor], region: int) -> list[torch.Tensor]:
    """A region's call as the outer graph makes it (the ops below, or this function itself under no_grad with
    fallback="eager", which skips the dispatcher)."""
    return _REGIONS[region].run(inputs)


def _fake_region(inputs: list[torch.Tensor], region: int) -> list[torch.Tensor]:
    return _REGIONS[region].fake(inputs)


# The inference op: a plain library kernel, about 7 us per call on a 2-core CPU where torch.library.custom_op's
# Python wrappers (autograd check, redispatch, dynamo-disable, aliasing check) took 33 us. It has no autograd
# kernel, so it is only placed in graphs compiled without gradients (Dynamo guards on grad mode).
_LIB = torch.library.Library("kiln_dynamo", "FRAGMENT")
_LIB.define("region(Tensor[] inputs, int region) -> Tensor[]")
_LIB.impl("region", run_region, "CompositeExplicitAutograd")
torch.library.register_fake("kiln_dynamo::region", _fake_region, lib=_LIB)


@custom_op("kiln_dynamo::region_autograd", mutates_args=())
def region_autograd(inputs: list[torch.Tensor], region: int) -> list[torch.Tensor]:
    """The region op in graphs compiled with gradients enabled: the forward runs, a backward raises."""
    return run_region(inputs, region)


region_autograd.register_fake(_fake_region)

INFERENCE_ONLY = "kiln's backend is for inference; use torch.no_grad() or another backend for training"


def _no_backward(ctx, grads):
    # Kiln kernels have no backward: say so, instead of torch's "no autograd formula" for the custom op.
    raise KilnError(f"{INFERENCE_ONLY} (a gradient reached a kiln region)")


region_autograd.register_autograd(_no_backward)
CALLS = {"op": torch.ops.kiln_dynamo.region.default, "autograd": torch.ops.kiln_dynamo.region_autograd.default,
         "direct": run_region}  # fmt: skip


def retarget(gm: fx.GraphModule, how: str) -> None:
    """Make gm's region calls `how` (a key of CALLS): "op" (inductor without gradients), "autograd" (gradients
    enabled: a backward reaching a region raises) or "direct" (eager without gradients: a Python call)."""
    targets = set(CALLS.values())
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in targets:
            n.target = CALLS[how]
    gm.recompile()


MAX_REFREEZES = 2  # per region: a weight load or two is re-frozen; one that changes on every call is not


@dataclass
class Region:
    rid: int
    ref: fx.GraphModule  # Level-1 kiln graph; every input (weights too) a placeholder
    frozen: dict[int, tuple[torch.Tensor, int]]  # input index -> (weight frozen into `fast`, its _version then)
    fast: Callable | None = None  # the lowered graph's forward over the non-frozen inputs
    passes: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # the kiln nodes of the outer graph it replaced
    inputs: list[str] = field(default_factory=list)  # the outer graph's nodes it reads
    fallbacks: int = 0
    # Builds `fast` again over other frozen weights (extract_regions sets it): a weight changed in place, through
    # .data or load_state_dict is frozen anew, at most MAX_REFREEZES times per region.
    rebuild: Callable[[dict], Callable] | None = None
    refreezes: int = 0

    def __post_init__(self) -> None:
        # Per-call work is a few attribute reads: the frozen weights as flat tuples, the live inputs' indices.
        # The address is taken now: `param.data = new` keeps the Parameter object (and its _version) but not its
        # memory. The detached alias keeps the old memory alive, so no new tensor can be given its address.
        self._frozen = tuple((i, v, t.data_ptr(), t.detach()) for i, (t, v) in self.frozen.items())
        self._live = tuple(i for i in range(len(self.ref.graph.find_nodes(op="placeholder"))) if i not in self.frozen)

    def _weights_ok(self, inputs: Sequence[torch.Tensor]) -> bool:
        # Shape, stride, dtype and device are Dynamo's guards on the weight inputs; what they miss is the same
        # memory changed in place (the version counter) or other memory behind the same Parameter (the address).
        for i, version, ptr, _ in self._frozen:
            x = inputs[i]
            if x._version != version or x.data_ptr() != ptr:
                return False
        return True

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Contiguous in and out: kernels take dense rows, and the fake kernel promises dense outputs.
        if self.fast is not None and not self._weights_ok(inputs) and self._may_refreeze():
            self._refreeze(inputs)
        if self.fast is not None and self._weights_ok(inputs):
            outs = self.fast(*[inputs[i].contiguous() for i in self._live])
        else:
            if self.fallbacks == 0 and self.fast is not None:
                warnings.warn(f"kiln region {self.rid}: a frozen weight changed again after {self.refreezes} "
                              "re-freezes; running its reference ops from now on (recompile to freeze it again)",
                              stacklevel=2)
            self.fallbacks += 1
            outs = self.ref(*[x.contiguous() for x in inputs])
        return [o.contiguous() for o in outs]

    def _may_refreeze(self) -> bool:
        # Not while a CUDA graph is captured (a rebuild compiles), nor for a weight that changes on every call (a
        # buffer the forward writes): a few re-freezes, then the reference ops.
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return self.rebuild is not None and self.refreezes < MAX_REFREEZES and not capturing

    def _refreeze(self, inputs: Sequence[torch.Tensor]) -> None:
        self.refreezes += 1
        self.frozen = {i: (inputs[i], inputs[i]._version) for i in self.frozen}
        self.fast = self.rebuild(self.frozen)
        self.__post_init__()

    def fake(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [o.contiguous() for o in self.ref(*[x.contiguous() for x in inputs])]


class _KilnOps(OperatorSupportBase):
    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return is_kiln(node)


def _hint(d: object) -> int:
    if isinstance(d, int):
        return d
    node = d.node
    return int(node.hint) if node.hint is not None else int(node.shape_env.size_hint(node.expr))


def _weight_name(placeholder: str) -> str:
    """L_self_modules_model_modules_norm_parameters_weight_ -> model.norm.weight (readable dumps and fused names)."""
    name = placeholder.removeprefix("L_self_").removeprefix("l_self_").rstrip("_")
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    return name.removeprefix("modules_").replace("modules_", "")


def _is_weight(node: object, example: object) -> bool:
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


def _build(
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


def _rebuild(ref: fx.GraphModule, frozen: dict, *, names: dict, use_kernels: bool | None,
             overrides: dict[str, bool] | None) -> Callable:
    return _build(ref, frozen, names, use_kernels, None, overrides)[0]


def _split_at_writes(graph: fx.Graph, parts: list[list[fx.Node]], order: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """The partitions (nodes in graph order) cut at every in-place op that lies between their nodes.

    The partitioner follows data edges only, and a region runs where its last node stood (its readers after it):
    a kiln op moved past an in-place op that writes what it reads would read the new value (`a = l1(h);
    h.mul_(2); b = l2(h)` as one region computes l1 on the doubled h). A region without a write inside its span
    moves nodes only past pure calls, whose results do not depend on when they run. Cutting a partition by
    position keeps the contracted graph acyclic: no path runs from a later piece back to an earlier one."""
    barriers = sorted(order[n] for n in graph.nodes if writes(n))
    if not barriers:
        return parts
    out = []
    for nodes in parts:
        pieces: dict[int, list[fx.Node]] = {}
        for n in nodes:
            pieces.setdefault(bisect.bisect(barriers, order[n]), []).append(n)
        out += pieces.values()
    return out


def extract_regions(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    use_kernels: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
    overrides: dict[str, bool] | None = None,
) -> list[Region]:
    """Replace every group of kiln ops in gm by a kiln_dynamo::region call (in place); returns the regions."""
    for n in gm.graph.nodes:
        # Indexing a kiln op's output (HF's hidden[:, -k:] before the lm_head) as a method call, the same
        # computation: the partitioner treats a node read only by operator.getitem as a tuple and pulls the
        # getitem into its producer's partition, and a getitem that also reads a SymInt (-k under dynamic shapes)
        # is pulled back and forth between the two forever.
        if n.op == "call_function" and n.target is operator.getitem and is_kiln(n.args[0]):
            n.op, n.target = "call_method", "__getitem__"
    parts = CapabilityBasedPartitioner(gm, _KilnOps(), allows_single_node_partition=True).propose_partitions()
    if not parts:
        return []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups = _split_at_writes(gm.graph, [sorted(p.nodes, key=order.__getitem__) for p in parts], order)
    # fuse_by_partitions re-creates the graph's nodes; aot_autograd (fallback="inductor") needs the source
    # Dynamo attached to each placeholder, so carry it over.
    sources = {n.name: n._dynamo_source for n in gm.graph.nodes if hasattr(n, "_dynamo_source")}
    fuse_by_partitions(
        gm,
        [dict.fromkeys(g) for g in groups],
        prefix=_PREFIX,
        always_return_tuple=True,
    )
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    regions = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith(_PREFIX):
            continue
        ref = getattr(gm, node.target)
        frozen, names = {}, {}
        for i, a in enumerate(node.args):
            example = example_inputs[placeholders[a]] if a in placeholders else None
            if _is_weight(a, example):
                frozen[i], names[i] = (example, example._version), _weight_name(a.name)
        rid = next(_ids)
        kiln_nodes = [n for n in ref.graph.nodes if is_kiln(n)]
        region = Region(rid, ref, frozen, ops=[str(n.target).split(".")[1] for n in kiln_nodes])
        region.nodes, region.inputs = [n.name for n in kiln_nodes], [a.name for a in node.args]
        sub_dump = Path(dump_dir) / f"region_{len(regions)}" if dump_dir is not None else None
        region.fast, region.passes, region.kernels = _build(ref, frozen, names, use_kernels, sub_dump, overrides)
        region.rebuild = functools.partial(_rebuild, ref, names=names, use_kernels=use_kernels, overrides=overrides)
        _REGIONS[rid] = region
        regions.append(region)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(CALLS["op"], (list(node.args), rid))
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
    for n in gm.graph.nodes:
        if n.name in sources:
            n._dynamo_source = sources[n.name]
    gm.graph.lint()
    gm.recompile()
    return regions
