"""`torch.compile(model, backend="kiln")`: Dynamo graphs -> kiln ops -> the kiln pass pipeline and kernels.

    model = torch.compile(model, backend="kiln")                              # the rest compiled by inductor
    model = torch.compile(model, backend="kiln", mode="reduce-overhead")      # ... and run as CUDA graphs
    model = torch.compile(model, backend="kiln", options={"fallback": "eager", "dump_dir": "kiln-dump"})

Per graph Dynamo hands over: normalize (kiln.dynamo.normalize: pattern-match the torch-level graph into kiln ops),
group the kiln ops into regions and send each through `build_pipeline` / `run_pipeline` and `lower` with its
generated kernels (kiln.dynamo.regions), and run everything else as torch: compiled by inductor with the regions
inside the same graph as opaque ops with fake kernels (fallback="inductor", the default: inductor neither breaks
the graph at a region nor sees into it), or the outer graph as is (fallback="eager").

Options (`options={...}`; any other key is a KilnError naming these):
  fallback     "inductor" (default) or "eager": how the unclaimed part of each graph runs
  mode         inductor's mode for the unclaimed part: "default", "reduce-overhead" (CUDA graphs around the whole
               graph, kiln regions included), "max-autotune", "max-autotune-no-cudagraphs". torch.compile's own
               mode= argument arrives here too (torch.compile refuses mode= together with options=); it needs
               fallback="inductor"
  dump_dir     write the Dynamo graph, the normalized graph, and per region the graph after every pass, the
               lowered graph and the kernels' requests (also KILN_DUMP_DIR)
  use_kernels  True / False / None (default: generated kernels when CUDA or TRITON_INTERPRET=1, else the
               kiln ops' reference implementations); True without either is refused up front
  passes       {pass name: bool} overrides of the default pipeline, as the CLI flags; kv_cache and mod_routing
               (the serving step graph, Mixture-of-Depths specs) cannot be turned on here
  claims       {kiln op: bool}: False leaves that op to torch, e.g. {"attention": False} where kiln.explain's
               timing shows kiln's attention slower than the fallback's (ops: attention, rms_norm, layer_norm,
               rope, gated_act, act, linear, add)
Every option is checked up front (names, types, known pass names, dump_dir writable): a KilnError naming the
option, which Dynamo reports wrapped in BackendCompilerFailed (kiln.dynamo.explain raises the KilnError itself).

Inference only: kiln kernels have no backward. The forward runs with gradients enabled, and a backward that
reaches a kiln region raises KilnError("kiln's backend is for inference; use torch.no_grad() or another
backend for training"). With fallback="inductor" and gradients enabled the outer graph runs eagerly (with a
warning), since aot_autograd would have to trace the regions' backward.

Dynamic shapes: kiln follows Dynamo's automatic dynamic shapes (torch.compile's default dynamic=None) and
does not bucket. The first call compiles for its exact shapes; when a later call changes a size (the sequence
length), Dynamo recompiles once with that dim symbolic, and that graph then serves every length. Kiln claims
only need the head count, head_dim and feature sizes static, which they are; batch and sequence dims may be
symbolic, and the kernels are shape-generic in them. HF generate() therefore compiles about three graphs (the
prefill, the first decode step, then one dynamic decode graph) whatever the number of steps, and one more
when the batch size changes; pass dynamic=True to start symbolic, or mark dims with
torch._dynamo.mark_dynamic to skip the static first graph. In a decode graph the cached keys and values are
separate inputs with their own length (and batch) symbols: attention claims them equal behind a Dynamo guard
(kiln.dynamo.fx_query.equal_guarded), as sdpa requires them equal anyway. Under dynamic=True Dynamo also passes float
constants (eps, the attention scale) as inputs; a claim specializes them with a guard on their value, and
inductor may make Dynamo restart the frame once to specialize the rest (the backend works on a copy of
Dynamo's graph, which Dynamo then clears, so kiln simply builds that graph again).
Masks computed in the graph are claimed behind a run-time value check (kiln.dynamo.masks): a call with
padding runs the original graph, compiled by inductor at the first such call when that is the fallback (else
eagerly), and says so once. Weights are frozen into the kiln regions, guarded per call (memory
address and version counter, so `param.data = ...` is seen too).

In-place ops in the graph (`+=`, `x[i] = v`, `.mul_`, ReLU(inplace=True)) run as torch where they stand; no claim
reads a value across one and no region is moved past one (kiln.dynamo.normalize, kiln.dynamo.regions).
Graphs are numbered per compile (per options dict; explain numbers its own from 0): report.index and
dump_dir/graph_<n>.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.dynamo.graph_report import Compiled, GraphReport, Stats, find_fallbacks
from kiln.dynamo.masks import MaskOracle
from kiln.dynamo.options import FALLBACKS, MODES, OPTIONS, Options, parse_options  # noqa: F401  (re-exported)
from kiln.dynamo.regions import INFERENCE_ONLY, extract_regions, retarget
from kiln.dynamo.rules import normalize

STATS = Stats()
# kiln.dynamo.explain listens while it runs: called with each graph's report and what was compiled.
_listeners: list[Callable[[GraphReport, Compiled], None]] = []


def reset_stats() -> None:
    global STATS
    STATS = Stats()


# Graph numbers (reports, warnings, dump_dir/graph_<n>) count per compile: per options dict, which torch.compile
# hands to every call of one compiled model (explain passes a fresh one); without options, per process. The dict
# is kept so that its id is not reused.
_numbering: dict[int, tuple[dict, itertools.count]] = {}
_unnumbered = itertools.count()


def _graph_index(options: dict[str, Any] | None) -> int:
    if not isinstance(options, dict):
        return next(_unnumbered)
    entry = _numbering.get(id(options))
    if entry is None or entry[0] is not options:
        entry = _numbering[id(options)] = (options, itertools.count())
    return next(entry[1])


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm (node meta included, and the Dynamo source of each placeholder, which aot_autograd reads)."""
    graph, env = fx.Graph(), {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return fx.GraphModule(gm, graph)


def _dump(path: Path | None, name: str, gm: fx.GraphModule) -> None:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(gm.print_readable(print_output=False))


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str) -> Callable[..., Any]:
    # inductor is imported when a graph first goes to it: fallback="eager" never loads it
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches=list_mode_options(mode) or None)


def _unclaimed(original: fx.GraphModule, opts: Any, grad: bool) -> Callable[..., Any]:
    """Dynamo's graph as it came, for the calls whose masks kiln did not claim: compiled by inductor (through
    torch.compile, which traces and guards its shapes itself) when that is the fallback, else run as torch."""
    if opts.fallback != "inductor" or grad:
        return original.forward
    return torch.compile(_copy(original), backend="inductor", mode=opts.mode if opts.mode != "default" else None)


def _may_record_grad(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether running the graph can record an autograd graph: an input (parameters are inputs) requires grad and
    gradients are on, at compile time or switched on inside the graph (`with torch.enable_grad()` in a forward
    called under no_grad: a _set_grad_enabled(True) node), which the compile-time mode does not show."""
    wants = any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
    wants = wants or any(p.requires_grad for p in gm.parameters())
    switched = any(n.args[:1] == (True,) for n in gm.graph.find_nodes(op="call_function",
                                                                        target=torch._C._set_grad_enabled))
    return wants and (torch.is_grad_enabled() or switched)


def kiln_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The Dynamo backend (registered as "kiln" through the torch_dynamo_backends entry point)."""
    opts = parse_options(options, mode)
    index = _graph_index(options)
    STATS.graphs += 1
    dump = Path(opts.dump_dir) / f"graph_{index}" if opts.dump_dir else None
    _dump(dump, "00_dynamo.py", gm)
    # Work on a copy: Dynamo clears its own graph afterwards, also when inductor makes it restart the frame
    # (TensorifyScalarRestartAnalysis, for the float inputs of dynamic=True), and the rewrite would break that.
    original, gm = _copy(gm), _copy(gm)
    oracle = MaskOracle(original, example_inputs)
    nz = normalize(gm, oracle.spec, opts.off)
    _dump(dump, "01_normalized.py", gm)
    fallbacks = find_fallbacks(gm, nz.rejections, opts.fallback)
    regions = extract_regions(gm, example_inputs, use_kernels=opts.use_kernels, dump_dir=dump, overrides=opts.passes)
    grad = _may_record_grad(gm, example_inputs)
    # Dynamo guards on grad mode and requires_grad, so a graph compiled here never runs in the other case.
    retarget(gm, "autograd" if grad else "op" if opts.fallback == "inductor" else "direct")
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
        opts.mode,
    )
    if opts.fallback == "inductor" and regions and grad:
        # aot_autograd would trace the regions' backward, which kiln does not have, and fail this forward;
        # run the outer graph eagerly so the forward works and only a backward raises the inference-only error.
        warnings.warn(
            f"kiln: graph {index} runs without inductor: gradients are enabled; {INFERENCE_ONLY}", stacklevel=2
        )
        compiled = gm.forward
    elif opts.fallback == "inductor":
        compiled = _inductor(gm, example_inputs, opts.mode)
    else:
        compiled = gm.forward
    # Counted once compiled: a frame inductor restarted (see above) comes back here and is counted then.
    STATS.regions += len(regions)
    STATS.claims.update(report.counts())
    STATS.reports.append(report)
    torch._dynamo.utils.counters["kiln"]["graphs"] += 1
    guard = oracle.guard(nz.masks) if nz.masks else None
    if guard is not None:
        STATS.guards.append(guard)

        unguarded: list[Callable[..., Any]] = []  # made at the first failure: most graphs never fail

        def run(*args: Any) -> Any:
            if guard(args):
                return compiled(*args)
            if not unguarded:
                unguarded.append(_unclaimed(original, opts, grad))
                how = "as torch" if unguarded[0] == original.forward else "by inductor"
                warnings.warn(f"kiln: graph {index}: an attention mask failed its run-time check (padding, or a "
                              "sliding window longer than the calls it was compiled on saw); such calls run the "
                              f"graph without kiln's kernels ({how})", stacklevel=2)
            return unguarded[0](*args)

    else:
        run = compiled
    if not _listeners:
        return run
    what = Compiled(run, compiled, original, gm, regions, guard)
    for listener in _listeners:
        listener(report, what)

    def recorded(*args: Any) -> Any:  # explain(timing=True) replays the latest call of every graph
        what.last_args = args
        return run(*args)

    return recorded
