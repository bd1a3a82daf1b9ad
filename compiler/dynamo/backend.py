"""`torch.compile(model, backend="kiln")`: Dynamo graphs -> kiln ops -> the kiln pass pipeline and kernels.

    model = torch.compile(model, backend="kiln", options={"fallback": "inductor", "dump_dir": "kiln-dump"})

Per graph Dynamo hands over: normalize (kiln.dynamo.normalize: pattern-match the torch-level graph into kiln ops),
group the kiln ops into regions and send each through `build_pipeline` / `run_pipeline` and `lower` with its
generated kernels (kiln.dynamo.regions), and run everything else as torch: the outer graph as is
(fallback="eager") or compiled by inductor with the regions as opaque custom ops (fallback="inductor").

Options (`options={...}`; any other key is a KilnError naming these):
  fallback     "eager" (default) or "inductor": how the unclaimed part of each graph runs
  dump_dir     write the Dynamo graph, the normalized graph, and per region the graph after every pass, the
               lowered graph and the kernels' requests (also KILN_DUMP_DIR)
  use_kernels  True / False / None (default: generated kernels when CUDA or TRITON_INTERPRET=1, else the
               kiln ops' reference implementations)
  passes       {pass name: bool} overrides of the default pipeline, as the CLI flags

Dynamic shapes: kiln follows Dynamo's automatic dynamic shapes (torch.compile's default dynamic=None) and
does not bucket. The first call compiles for its exact shapes; when a later call changes a size (the sequence
length), Dynamo recompiles once with that dim symbolic, and that graph then serves every length. Kiln claims
only need the head count, head_dim and feature sizes static, which they are; batch and sequence dims may be
symbolic, and the kernels are shape-generic in them. HF generate() therefore compiles about three graphs (the
prefill, the first decode step, then one dynamic decode graph) whatever the number of steps; pass
dynamic=True to start symbolic, or mark dims with torch._dynamo.mark_dynamic to skip the static first graph.
Masks computed in the graph are claimed behind a run-time value check (kiln.dynamo.masks): a call with
padding runs the original graph eagerly. Weights are frozen into the kiln regions, guarded per call.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.dynamo.masks import MaskOracle
from kiln.dynamo.normalize import Claim, Rejection, canon, is_kiln, normalize, site_of
from kiln.dynamo.regions import extract_regions
from kiln.errors import KilnError

FALLBACKS = ("eager", "inductor")
OPTIONS = ("dump_dir", "fallback", "passes", "use_kernels")
# Torch calls that only move data around (views, casts, shape queries): not reported as fallen-back compute.
_GLUE = {"reshape", "transpose", "contiguous", "getitem", "unsqueeze", "expand", "cast", "size", "flatten",
         "unflatten", "dropout", "sym_sum"}  # fmt: skip


@dataclass(frozen=True)
class Options:
    fallback: str = "eager"
    dump_dir: str | None = None
    use_kernels: bool | None = None
    passes: dict[str, bool] | None = None


def parse_options(options: dict[str, Any] | None) -> Options:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise KilnError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for backend 'kiln'; allowed: {', '.join(OPTIONS)}"
        )
    fallback = options.get("fallback", "eager")
    if fallback not in FALLBACKS:
        raise KilnError(f"option fallback={fallback!r} for backend 'kiln'; expected one of {', '.join(FALLBACKS)}")
    use_kernels = options.get("use_kernels")
    if use_kernels not in (None, True, False):
        raise KilnError(f"option use_kernels={use_kernels!r}; expected True, False or None")
    dump = options.get("dump_dir") or os.environ.get("KILN_DUMP_DIR") or None
    return Options(fallback, str(dump) if dump else None, use_kernels, options.get("passes"))


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
    fallback: str = "eager"

    def counts(self) -> Counter:
        """Claimed kiln ops by name (attention, rms_norm, layer_norm, rope, gated_act, act, linear, add)."""
        return Counter(c.op for c in self.claims)


@dataclass
class Stats:
    graphs: int = 0  # graphs compiled by this backend in this process (recompilations included)
    regions: int = 0
    claims: Counter = field(default_factory=Counter)
    reports: list[GraphReport] = field(default_factory=list)
    guards: list[Any] = field(default_factory=list)

    @property
    def mask_fallbacks(self) -> int:
        """Calls whose masks failed the run-time check and ran the original graph instead."""
        return sum(g.failures for g in self.guards)


STATS = Stats()
_listeners: list[list[GraphReport]] = []  # kiln.dynamo.explain collects reports here while it runs


def reset_stats() -> None:
    global STATS
    STATS = Stats()


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _fallbacks(gm: fx.GraphModule, rejections: list[Rejection], fallback: str) -> list[Fallback]:
    why = {r.node: f"{r.pattern}: {r.reason}" for r in rejections}
    groups: dict[str, Fallback] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module") or is_kiln(n):
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


def _dump(path: Path | None, name: str, gm: fx.GraphModule) -> None:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(gm.print_readable(print_output=False))


def kiln_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The Dynamo backend (registered as "kiln" through the torch_dynamo_backends entry point)."""
    opts = parse_options(options)
    index = STATS.graphs
    STATS.graphs += 1
    dump = Path(opts.dump_dir) / f"graph_{index}" if opts.dump_dir else None
    _dump(dump, "00_dynamo.py", gm)
    original = _copy(gm)
    oracle = MaskOracle(original, example_inputs)
    nz = normalize(gm, oracle.spec)
    _dump(dump, "01_normalized.py", gm)
    fallbacks = _fallbacks(gm, nz.rejections, opts.fallback)
    regions = extract_regions(gm, example_inputs, use_kernels=opts.use_kernels, dump_dir=dump, overrides=opts.passes)
    _dump(dump, "02_regions.py", gm)
    report = GraphReport(
        index,
        nz.claims,
        nz.rejections,
        fallbacks,
        len(regions),
        sorted({k for r in regions for k in r.kernels}),
        dict(nz.masks),
        opts.fallback,
    )
    STATS.regions += len(regions)
    STATS.claims.update(report.counts())
    STATS.reports.append(report)
    for listener in _listeners:
        listener.append(report)
    torch._dynamo.utils.counters["kiln"]["graphs"] += 1
    if opts.fallback == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, list(example_inputs))
    else:
        compiled = gm.forward
    if not nz.masks:
        return compiled
    guard = oracle.guard(nz.masks)
    STATS.guards.append(guard)

    def run(*args: Any) -> Any:
        return compiled(*args) if guard(args) else original.forward(*args)

    return run
