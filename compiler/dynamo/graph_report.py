"""What the backend made of each Dynamo graph: its report (claims, refused matches, what runs as torch, regions,
kernels, masks), the process-wide counters, and the compiled pieces kiln.dynamo.explain's timing replays.

A torch call in the normalized graph that computes on tensors and is not a kiln op is reported as a Fallback,
grouped by op and reason; calls that only move data (views, casts, shape queries) are not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from kiln.dynamo.fx_query import canon, is_kiln, site_of, val
from kiln.dynamo.masks import MaskGuard
from kiln.dynamo.mutation import writes
from kiln.dynamo.normalize import Claim, Rejection
from kiln.dynamo.regions import Region

# Torch calls that only move data around (views, casts, shape queries): not reported as fallen-back compute.
_GLUE = {"reshape", "transpose", "contiguous", "clone", "getitem", "unsqueeze", "expand", "cast", "size", "flatten",
         "unflatten", "permute", "dropout", "sym_sum"}  # fmt: skip


@dataclass
class Fallback:
    op: str  # the torch call that runs as torch
    count: int
    sites: list[str]
    reason: str


@dataclass
class GraphReport:
    """What kiln did with one Dynamo graph."""

    index: int
    claims: list[Claim]
    rejections: list[Rejection]
    fallbacks: list[Fallback]
    regions: int = 0
    kernels: list[str] = field(default_factory=list)
    masks: dict[str, tuple[bool, int]] = field(default_factory=dict)
    fallback: str = "inductor"
    mode: str = "default"

    def counts(self) -> Counter:
        """Claimed kiln ops by name (attention, rms_norm, layer_norm, rope, gated_act, act, linear, add)."""
        return Counter(c.op for c in self.claims)


@dataclass
class Stats:
    graphs: int = 0  # graphs handed to this backend in this process (recompilations and restarts included)
    regions: int = 0
    claims: Counter = field(default_factory=Counter)
    reports: list[GraphReport] = field(default_factory=list)
    guards: list[Any] = field(default_factory=list)

    @property
    def mask_fallbacks(self) -> int:
        """Calls whose masks failed the run-time check and ran the original graph instead."""
        return sum(g.failures for g in self.guards)


@dataclass
class Compiled:
    """What the backend made of one graph, for kiln.dynamo.explain's timing: the callable Dynamo runs, the graph
    as Dynamo handed it over (the eager baseline), the outer graph with its region calls, and the regions."""

    run: Callable[..., Any]
    inner: Callable[..., Any]  # run without the mask check
    original: fx.GraphModule
    outer: fx.GraphModule
    regions: list[Region]
    guard: MaskGuard | None = None
    last_args: tuple | None = None  # the inputs of the latest call (kept only while explain listens)


def _has_tensor(v: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(v))


def _tensor_compute(n: fx.Node) -> bool:
    """Whether n computes on tensors: reads one and returns or writes one. Not the host-side calls Dynamo's graph
    holds besides (_log_api_usage_once, torch.tensor of Python numbers, numel, .item(), SymInt comparisons)."""
    if not any(_has_tensor(val(a)) for a in n.all_input_nodes):
        return False
    return _has_tensor(val(n)) or bool(writes(n))


def find_fallbacks(gm: fx.GraphModule, rejections: list[Rejection], fallback: str) -> list[Fallback]:
    why = {r.node: f"{r.pattern}: {r.reason}" for r in rejections}
    groups: dict[str, Fallback] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module") or is_kiln(n) or not _tensor_compute(n):
            continue
        op = canon(n)
        if op is not None and op.name in _GLUE:
            continue
        name = op.name if op is not None else str(getattr(n.target, "__name__", n.target))
        reason = why.get(n.name, f"no kiln pattern matches; runs as {fallback}")
        fb = groups.setdefault(f"{name}|{reason}", Fallback(name, 0, [], reason))
        fb.count += 1
        if len(fb.sites) < 4:
            fb.sites.append(site_of(n))
    return list(groups.values())
