"""`kiln.explain(..., timing=True)`: where the time of each compiled graph goes, kiln against eager and inductor.

For every graph the backend compiled, on the inputs of its last call (captured while explain ran the model):
  total         the callable Dynamo runs (kiln's: regions, the rest under the fallback, mask checks) against
                the graph as Dynamo handed it over, run eagerly and compiled by inductor (compile_fx)
  region i      one kiln region (its call as the graph makes it: weight check, kernels, output copies), on the
                inputs it received, against the torch nodes it replaced (their "cone": the nodes computing the
                region's values whose results nothing else reads), eagerly and compiled by inductor
  mask checks   the per-call check of claimed masks (kiln only; the baselines have none)
  rest          the same graph with every region (kiln) or cone (eager, inductor) replaced by an opaque op that
                returns the values it recorded: the unclaimed part with its glue, measured on its own
Times are medians over `iters` calls after warm-up: CUDA events when the graph's tensors are on a GPU, else
perf_counter. Nothing here is asserted anywhere: it is for reading.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from kiln.dynamo.fx_query import val
from kiln.dynamo.graph_report import Compiled, GraphReport
from kiln.dynamo.regions import _REGIONS, CALLS, Region, new_region_id

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


def times_ms(fn: Callable[[], Any], iters: int, cuda: bool, warmup: int = 2,
             setup: Callable[[], Any] | None = None) -> list[float]:
    """Milliseconds of each of `iters` calls of fn() (CUDA events on a GPU) after `warmup` untimed calls; setup(),
    when given, runs before every call, untimed."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
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
    return times


def median_ms(fn: Callable[[], Any], iters: int, cuda: bool, warmup: int = 2) -> float:
    return statistics.median(times_ms(fn, iters, cuda, warmup))


def _inductor(gm: fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx  # only when an inductor baseline is asked for

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


class _Replay:
    """Stands in for a region (or a cone of torch nodes): returns the values recorded for it, no compute."""

    def __init__(self, outputs: Sequence[torch.Tensor]):
        self.outputs = list(outputs)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.outputs)

    def fake(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in self.outputs]


@dataclass
class _Cone:
    gm: fx.GraphModule  # the cone as a graph over `needs`
    nodes: set[fx.Node]  # of the original graph
    needs: list[fx.Node]


def _cone(original: fx.GraphModule, replaced: set[str], stop: set[str]) -> _Cone | None:
    """The nodes of `original` that compute the values in `replaced` and whose results nothing else reads, back to
    the nodes named in `stop` (the region's inputs, other regions' values), as a graph over the values they read;
    None when none of them is in the graph."""
    cone = {n for n in original.graph.nodes if n.name in replaced}
    if not cone:
        return None
    for n in reversed(list(original.graph.nodes)):
        if n in cone or n.name in stop or n.op not in ("call_function", "call_method"):
            continue
        if n.users and set(n.users) <= cone:
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
    return _Cone(fx.GraphModule(original, graph), cone, inputs)


def _rest(original: fx.GraphModule, values: dict[str, torch.Tensor]) -> fx.GraphModule | None:
    """A copy of `original` where every node named in `values` is a replay op returning its recorded value (reading
    the graph's first tensor input, so that the op has a device to dispatch on), and the torch nodes only they
    needed are gone. None when the graph has no tensor input."""
    gm = _copy(original)
    first = next((n for n in gm.graph.find_nodes(op="placeholder") if isinstance(val(n), torch.Tensor)), None)
    if first is None:
        return None
    for n in list(gm.graph.nodes):
        if n.name in values:
            rid = new_region_id()
            _REGIONS[rid] = _Replay([values[n.name]])
            with gm.graph.inserting_before(n):
                call = gm.graph.call_function(CALLS["op"], ([first], rid))
                item = gm.graph.call_function(operator.getitem, (call, 0))
            n.replace_all_uses_with(item)
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


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

    def ms(fn: Callable[[], Any]) -> float:
        return median_ms(fn, iters, cuda)

    def baseline(gm: fx.GraphModule, vals: Sequence[Any], kind: str) -> float:
        fn = gm.forward if kind == "eager" else _inductor(gm, vals)
        return ms(lambda: fn(*vals))

    rows: list[Timing] = []
    saved = {r.rid: r for r in compiled.regions}
    with torch.no_grad():
        captures = {rid: _Capture(r) for rid, r in saved.items()}
        _REGIONS.update(captures)
        try:
            compiled.run(*args)
        finally:
            _REGIONS.update(saved)
        total = Timing("total", "the whole graph", ms(lambda: compiled.run(*args)))
        for b in baselines:
            setattr(total, b, baseline(_copy(compiled.original), args, b))
        replaced = [{c.replaced for c in report.claims if c.node in set(r.nodes)} for r in compiled.regions]
        everything = set().union(*replaced)
        cones = [_cone(compiled.original, mine, set(r.inputs) | (everything - mine))
                 for r, mine in zip(compiled.regions, replaced, strict=True)]  # fmt: skip
        # the cones' inputs, and their outputs (what the rest reads of them)
        outputs = {n.name for c in cones if c is not None for n in c.nodes if any(u not in c.nodes for u in n.users)}
        keep = {n for c in cones if c is not None for n in c.needs} | {
            n for n in compiled.original.graph.nodes if n.name in outputs
        }
        values = _Values(compiled.original, keep)
        values.run(*args)
        for i, (region, cone) in enumerate(zip(compiled.regions, cones, strict=True)):
            inputs = captures[region.rid].inputs
            row = Timing(f"region {i}", _label(region), ms(lambda r=region, x=inputs: r.run(x)))
            if cone is not None:
                vals = [values.kept[n] for n in cone.needs]
                for b in baselines:
                    setattr(row, b, baseline(cone.gm, vals, b))
            rows.append(row)
        if compiled.guard is not None:
            rows.append(Timing("mask checks", "claimed masks re-checked", ms(lambda: compiled.guard(args))))
        _REGIONS.update({rid: _Replay(c.outputs) for rid, c in captures.items()})
        try:
            rest = Timing("rest", "unclaimed ops and glue, regions replayed", ms(lambda: compiled.inner(*args)))
        finally:
            _REGIONS.update(saved)
        rest_gm = _rest(compiled.original, {n.name: v for n, v in values.kept.items() if n.name in outputs})
        for b in baselines if rest_gm is not None else ():
            setattr(rest, b, baseline(rest_gm, args, b))
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
