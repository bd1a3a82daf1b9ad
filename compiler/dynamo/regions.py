"""Kiln regions: connected groups of claimed kiln ops, each run through the pass pipeline and lowered to kernels.

After normalization the graph mixes kiln ops and torch calls. The kiln ops are grouped into maximal regions
(torch.fx's CapabilityBasedPartitioner, which keeps the contracted graph acyclic); each region becomes a
Level-1 kiln graph (the same IR the spec frontend builds), goes through `build_pipeline` / `run_pipeline` and
`lower` like a spec file (kiln.dynamo.region_build), and is called from the outer graph through one opaque custom op,
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
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.library import custom_op

from kiln.dynamo.fx_query import is_kiln
from kiln.dynamo.mutation import writes
from kiln.dynamo.region_build import build_region, is_weight, rebuild_region, weight_name
from kiln.errors import KilnError

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
            if is_weight(a, example):
                frozen[i], names[i] = (example, example._version), weight_name(a.name)
        rid = next(_ids)
        kiln_nodes = [n for n in ref.graph.nodes if is_kiln(n)]
        region = Region(rid, ref, frozen, ops=[str(n.target).split(".")[1] for n in kiln_nodes])
        region.nodes, region.inputs = [n.name for n in kiln_nodes], [a.name for a in node.args]
        sub_dump = Path(dump_dir) / f"region_{len(regions)}" if dump_dir is not None else None
        region.fast, region.passes, region.kernels = build_region(ref, frozen, names, use_kernels, sub_dump, overrides)
        region.rebuild = functools.partial(rebuild_region, ref, names=names, use_kernels=use_kernels,
                                           overrides=overrides)
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
