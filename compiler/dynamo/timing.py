"""`kiln.explain(..., timing=True)`: where the time of each compiled graph goes, kiln against eager and inductor.

For every graph the backend compiled, on the inputs of its last call (captured while explain ran the model):
  total         the callable Dynamo runs (kiln's: regions, the rest under the fallback, mask checks) against
                the graph as Dynamo handed it over, run eagerly and compiled by inductor (compile_fx)
  region i      one kiln region (its call as the graph makes it: weight check, kernels, output copies), on the
                inputs it received, against the torch nodes it replaced (their "cone": the nodes computing the
                region's values whose results nothing else reads), eagerly and compiled by inductor
  mask checks   the per-call check of claimed masks (kiln only; the baselines have none)
  rest          total minus the regions (and mask checks): the unclaimed part with its glue
Times are medians over `iters` calls after warm-up: CUDA events when the graph's tensors are on a GPU, else
perf_counter. Nothing here is asserted anywhere: it is for reading.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from kiln.dynamo.backend import Compiled, GraphReport
from kiln.dynamo.regions import _REGIONS, Region

BASELINES = ("eager", "inductor")


@dataclass
class Timing:
    part: str  # "total", "region 0", "mask checks", "rest"
    what: str  # the kiln ops of a region, or a short description
    kiln: float  # ms
    eager: float | None = None
    inductor: float | None = None

    def ratio(self, baseline: str) -> float | None:
        base = getattr(self, baseline)
        return self.kiln / base if base and self.kiln else None


def median_ms(fn: Callable[[], Any], iters: int, cuda: bool, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _inductor(gm: fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(args))


class _Capture:
    """Stands in for a region in kiln.dynamo.regions._REGIONS: runs it and keeps its last inputs and outputs."""

    def __init__(self, region: Region):
        self.region, self.inputs, self.outputs = region, None, None

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.inputs, self.outputs = list(inputs), self.region.run(inputs)
        return self.outputs

    def fake(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.region.fake(inputs)


def _cone(original: fx.GraphModule, replaced: set[str]) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """The nodes of `original` that compute the values in `replaced` and whose results nothing else reads, as a
    graph over the values they read (returned too), or None when none of them is in the graph."""
    cone = {n for n in original.graph.nodes if n.name in replaced}
    if not cone:
        return None
    for n in reversed(list(original.graph.nodes)):
        if n not in cone and n.op in ("call_function", "call_method") and n.users and set(n.users) <= cone:
            cone.add(n)
    graph, env = fx.Graph(), {}
    inputs = [n for n in original.graph.nodes if n not in cone and any(u in cone for u in n.users)]
    for n in inputs:
        env[n] = graph.placeholder(n.name)
    outputs = []
    for n in original.graph.nodes:
        if n in cone:
            env[n] = graph.node_copy(n, env.__getitem__)
            if any(u not in cone for u in n.users):
                outputs.append(env[n])
    graph.output(tuple(outputs))
    return fx.GraphModule(original, graph), inputs


class _Values(fx.Interpreter):
    """Runs a graph and keeps the values of the nodes in `keep`."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node]):
        super().__init__(gm, garbage_collect_values=False)
        self.keep, self.kept = keep, {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.keep:
            self.kept[n] = out
        return out


def _label(region: Region) -> str:
    counts: dict[str, int] = {}
    for op in region.ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(op + (f" x{k}" if k > 1 else "") for op, k in counts.items())


def time_graph(
    report: GraphReport, compiled: Compiled, args: Sequence[Any], iters: int, baselines: Sequence[str]
) -> list[Timing]:
    """The Timing rows of one graph (see the module docstring), measured on `args`."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    rows: list[Timing] = []
    with torch.no_grad():
        captures = {r.rid: _Capture(r) for r in compiled.regions}
        _REGIONS.update(captures)
        try:
            compiled.run(*args)
        finally:
            _REGIONS.update({r.rid: r for r in compiled.regions})
        total = Timing("total", "the whole graph", median_ms(lambda: compiled.run(*args), iters, cuda))
        for b in baselines:
            fn = compiled.original.forward if b == "eager" else _inductor(_copy(compiled.original), args)
            setattr(total, b, median_ms(lambda fn=fn: fn(*args), iters, cuda))
        cones = {}
        for region in compiled.regions:
            replaced = {c.replaced for c in report.claims if c.node in set(region.nodes)}
            cones[region.rid] = _cone(compiled.original, replaced)
        keep = {n for cone in cones.values() if cone is not None for n in cone[1]}
        values = _Values(compiled.original, keep)
        values.run(*args)
        for i, region in enumerate(compiled.regions):
            inputs = captures[region.rid].inputs
            if inputs is None:  # not reached on this call (a branch Dynamo traced does not exist: defensive)
                continue
            row = Timing(f"region {i}", _label(region), median_ms(lambda r=region, x=inputs: r.run(x), iters, cuda))
            cone = cones[region.rid]
            if cone is not None:
                gm, needs = cone
                vals = [values.kept[n] for n in needs]
                for b in baselines:
                    fn = gm.forward if b == "eager" else _inductor(gm, vals)
                    setattr(row, b, median_ms(lambda fn=fn, v=vals: fn(*v), iters, cuda))
            rows.append(row)
        guard = compiled.guard
        if guard is not None:
            rows.append(Timing("mask checks", "claimed masks re-checked", median_ms(lambda: guard(args), iters, cuda)))
    rest = Timing("rest", "total - regions - mask checks", total.kiln - sum(r.kiln for r in rows))
    for b in baselines:
        parts = [getattr(r, b) for r in rows if r.part.startswith("region")]
        if getattr(total, b) is not None and None not in parts:
            setattr(rest, b, getattr(total, b) - sum(parts))
    return [*rows, rest, total]


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def format_timings(rows: Sequence[Timing], baselines: Sequence[str]) -> list[str]:
    head = f"  {'part':<12} {'kiln ms':>9}" + "".join(f" {b + ' ms':>12}" for b in baselines)
    head += "".join(f" {'vs ' + b:>12}" for b in baselines) + "  what"
    lines = [head]
    for r in rows:
        cells = "".join(f" {getattr(r, b):>12.3f}" if getattr(r, b) is not None else f" {'-':>12}" for b in baselines)
        ratios = [r.ratio(b) for b in baselines]
        cells += "".join(f" {x:>11.2f}x" if x is not None else f" {'-':>12}" for x in ratios)
        slower = any(x is not None and x > 1.0 for x in ratios)
        lines.append(f"  {r.part:<12} {r.kiln:>9.3f}{cells}  {r.what}" + ("  <- kiln slower" if slower else ""))
    return lines
