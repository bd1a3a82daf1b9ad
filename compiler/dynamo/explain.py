"""`kiln.explain(model, *example_inputs)`: what backend="kiln" claims in a model, and what runs as torch and why.

    print(kiln.explain(model, input_ids))
    print(kiln.explain(model, input_ids, generate=8))   # every graph of an HF generate(): prefill and decode
    print(kiln.explain(model, input_ids, timing=True))  # + per region and the rest: kiln vs eager / inductor ms
    print(kiln.explain(model, input_ids=ids, attention_mask=am, options={"fallback": "eager"}))  # model kwargs

Runs the model once (or, with generate=N, `model.generate(..., max_new_tokens=N)` with model.forward compiled,
so the decode graphs with their variable key length show too) under torch.compile with the kiln backend
(no_grad) and collects, per Dynamo graph, each claimed site (kiln op, module path, parameters), each pattern
that matched but was refused (with the reason: a dtype that torch would promote, a mask that is not causal,
a head_dim the kernel does not take, ...), and the torch calls that fell back to eager / inductor, grouped by op
with a few example sites. The header sums claims and refusals over all graphs and says whether generated kernels
or kiln's reference ops run the claims. timing=True then times every graph on the inputs of its last call: each
kiln region, the mask checks and the rest against the same torch nodes run eagerly and compiled by inductor
(kiln.dynamo.timing), marking the parts where kiln is slower.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.dynamo.backend import OPTIONS, _listeners, kiln_backend, parse_options
from kiln.dynamo.graph_report import Compiled, GraphReport
from kiln.dynamo.timing import BASELINES, Timing, format_timings, time_graph
from kiln.errors import KilnError


@dataclass
class ExplainReport:
    graphs: list[GraphReport]
    timings: dict[int, list[Timing]] = field(default_factory=dict)  # graph index -> rows (timing=True)
    baselines: tuple[str, ...] = BASELINES
    limits: list[str] = field(default_factory=list)  # Dynamo's recompile-limit warnings during the run

    def counts(self) -> Counter:
        """Claimed kiln ops over all graphs, by op name."""
        total: Counter = Counter()
        for g in self.graphs:
            total.update(g.counts())
        return total

    @property
    def claimed(self) -> bool:
        return any(g.claims for g in self.graphs)

    def refusals(self) -> Counter:
        """Patterns matched but refused over all graphs, by pattern name."""
        return Counter(r.pattern for g in self.graphs for r in g.rejections)

    def _kernels(self) -> str:
        kernels = sorted({k for g in self.graphs for k in g.kernels})
        if kernels:
            return f"{len(kernels)} generated"
        if self.claimed:  # claimed ops, but lowered to their torch reference implementations
            return "none (claimed ops run as kiln reference ops: no CUDA, TRITON_INTERPRET unset or use_kernels=False)"
        return "none"

    def __str__(self) -> str:
        counts = ", ".join(f"{op} {n}" for op, n in sorted(self.counts().items())) or "nothing"
        refused = ", ".join(f"{p} {n}" for p, n in sorted(self.refusals().items())) or "nothing"
        lines = [
            f"kiln explain: {len(self.graphs)} graph(s); kiln ops claimed: {counts}; refused: {refused}; "
            f"kernels: {self._kernels()}"
        ]
        if not self.graphs:
            why = "; ".join(self.limits) or (
                "the model ran no tensor op Dynamo could capture, or Dynamo is disabled (torch._dynamo.config.disable "
                "/ TORCHDYNAMO_DISABLE)"
            )
            lines.append(f"Dynamo compiled no graph, so kiln saw nothing: {why}")
        elif self.limits:
            lines.append(f"the rest ran eagerly, not shown: {'; '.join(self.limits)}")
        for g in self.graphs:
            lines.append(
                f"graph {g.index}: {len(g.claims)} claim(s) in {g.regions} region(s); "
                f"kernels: {', '.join(g.kernels) or 'none'}; unclaimed parts run as {g.fallback}"
            )
            for c in g.claims:
                lines.append(f"  claimed   {c.op:<10} {c.site}" + (f"  ({c.detail})" if c.detail else ""))
            for name, (causal, window) in g.masks.items():
                lines.append(f"  mask      %{name} claimed as causal={causal} window={window}, checked every call")
            for r in g.rejections:
                lines.append(f"  refused   {r.pattern:<10} {r.site}: {r.reason}")
            for f in g.fallbacks:
                sites = ", ".join(f.sites) + (", ..." if f.count > len(f.sites) else "")
                lines.append(f"  fallback  {f.op} x{f.count} ({sites}): {f.reason}")
            if g.index in self.timings:
                lines.append(f"  timing of graph {g.index} (median ms; on the inputs of its last call):")
                lines += ["  " + line for line in format_timings(self.timings[g.index], self.baselines)]
        return "\n".join(lines)


def _split_kwargs(
    model: Any, options: dict[str, Any] | None, kwargs: dict[str, Any], generate: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(backend options, the model's keyword inputs) from explain's keyword arguments: with options= every keyword
    goes to the model; without, the names of backend options stay options (the documented short form) and the rest
    go to the model, which must take them."""
    if options is not None:
        if not isinstance(options, dict):
            raise KilnError(f"explain(options={options!r}): expected a dict of backend options, as torch.compile's")
        return dict(options), kwargs
    opts = {k: v for k, v in kwargs.items() if k in OPTIONS}
    inputs = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    fn = model.generate if generate is not None else getattr(model, "forward", model)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to check: let the model say
        return opts, inputs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = sorted(k for k in inputs if k not in names)
        if unknown:
            raise KilnError(
                f"explain: {', '.join(map(repr, unknown))} is neither a backend option (allowed: {', '.join(OPTIONS)}) "
                f"nor an input of the model ({', '.join(sorted(names)) or 'none by keyword'})"
            )
        return opts, inputs
    # forward(**kwargs) (every HF model) takes any name: one that is not a named input but is close to an option
    # (or to explain's own keywords) is taken for a misspelling rather than handed to the model, which would ignore it.
    ours = (*OPTIONS, *_EXPLAIN_KEYWORDS)
    typos = {k: close[0] for k in sorted(inputs) if k not in names and (close := _close(k, ours))}
    if typos:
        raise KilnError(
            "explain: "
            + "; ".join(f"{k!r} is not an option (did you mean {v!r}?)" for k, v in typos.items())
            + f" (backend options: {', '.join(OPTIONS)}; explain's: {', '.join(_EXPLAIN_KEYWORDS)}; to pass a model "
            "input of that name, give the backend options as options={...})"
        )
    return opts, inputs


_EXPLAIN_KEYWORDS = ("generate", "timing", "iters", "baselines", "options")


def _close(name: str, candidates: Sequence[str]) -> list[str]:
    return difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)


def _fresh_code(fn: types.FunctionType) -> types.FunctionType:
    """fn with a code object of its own (same bytecode, closure, defaults and attributes, so inspect.signature and
    functools.wraps' __wrapped__ still work)."""
    code = fn.__code__.replace(co_varnames=fn.__code__.co_varnames)  # a new object, equal to the old
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    return new


@contextlib.contextmanager
def _own_forward(model: Any) -> Iterator[Callable[..., Any]]:
    """Yields what explain compiles: model, whose forward is for the duration a copy with its own code object.

    Dynamo keeps compiled graphs, and counts recompiles against config.recompile_limit, per code object; explain's
    fresh backend never matches the graphs already there, so compiling the model's own forward (HF's `wrapper`,
    which every HF model shares) would use up one recompile of the user's budget per explain call."""
    if isinstance(model, types.FunctionType):
        yield _fresh_code(model)
        return
    bound = getattr(model, "forward", None)
    fn = getattr(bound, "__func__", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(fn, types.FunctionType) or bound.__self__ is not model:
        yield model
        return
    had, old = "forward" in model.__dict__, model.__dict__.get("forward")
    model.forward = types.MethodType(_fresh_code(fn), model)
    try:
        yield model
    finally:
        if had:
            model.forward = old
        else:
            del model.forward


class _LimitLog(logging.Handler):
    """Collects Dynamo's "hit config.recompile_limit" warnings: past the limit a frame silently runs eagerly."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        lines = [line.strip() for line in record.getMessage().splitlines()]
        if lines and lines[0].startswith("torch._dynamo hit config."):
            where = " ".join(lines[1:2]).removeprefix("function: ")
            self.hits.append(
                f"Dynamo hit {lines[0].removeprefix('torch._dynamo hit ')} for {where} and runs it eagerly from then "
                "on (torch._dynamo.reset() clears its cache; the limit is torch._dynamo.config.recompile_limit)"
            )


def explain(
    model: torch.nn.Module | Any,
    *example_inputs: Any,
    generate: int | None = None,
    timing: bool = False,
    iters: int = 10,
    baselines: Sequence[str] = BASELINES,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ExplainReport:
    """Compile `model` with backend="kiln", run it once on example_inputs (and keyword inputs) without gradients,
    and report what kiln claimed in every graph Dynamo compiled.

    Backend options as in torch.compile(..., options=...): `options={...}`, or as keywords named like them
    (`explain(model, ids, fallback="eager")`); any other keyword is an input of the model
    (`explain(model, input_ids=ids, attention_mask=am)`). With options= given, every keyword goes to the model.
    generate=N: instead compile model.forward and run a greedy `model.generate(*example_inputs,
    max_new_tokens=N, **inputs)` (an HF model), so the report covers the prefill and the decode-step graphs.
    timing=True: then time every graph on the inputs of its last call, per kiln region, mask checks and the rest,
    against `baselines` ("eager" and / or "inductor"), median of `iters` calls (kiln.dynamo.timing).
    Graphs are numbered from 0 in each call.
    """
    options, inputs = _split_kwargs(model, options, kwargs, generate)
    parse_options(options)  # a bad option is a KilnError here, not a backend failure inside Dynamo
    if generate is not None and (not isinstance(generate, int) or generate < 1 or not hasattr(model, "generate")):
        raise KilnError(f"explain(generate={generate!r}) needs a positive int and a model with .generate (HF)")
    if not isinstance(iters, int) or iters < 1 or not set(baselines) <= set(BASELINES):
        raise KilnError(
            f"explain(iters={iters!r}, baselines={baselines!r}): iters is a positive int, baselines a subset of "
            f"{BASELINES}"
        )
    reports: list[GraphReport] = []
    compiled: list[Compiled] = []

    def listen(report: GraphReport, what: Compiled) -> None:
        reports.append(report)
        compiled.append(what)

    _listeners.append(listen)
    limits = _LimitLog()
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    dynamo_log.addHandler(limits)
    # A fresh backend object: Dynamo recompiles instead of reusing graphs compiled without this report. The
    # options dict is a fresh one too: the backend numbers graphs per options dict, so this call's from 0.
    backend = functools.partial(kiln_backend, options=options)
    # Where torch has it, explain's graphs also count in a recompile bucket of their own for the frames below
    # forward that a graph break makes Dynamo compile separately (their code objects are the user's).
    isolate = (
        {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
    )
    try:
        with torch.no_grad(), _own_forward(model) as target:
            if generate is None:
                torch.compile(target, backend=backend, **isolate)(*example_inputs, **inputs)
            else:
                had, old = "forward" in model.__dict__, model.__dict__.get("forward")
                model.forward = torch.compile(model.forward, backend=backend, **isolate)
                try:
                    model.generate(*example_inputs, max_new_tokens=generate, do_sample=False, **inputs)
                finally:
                    if had:  # _own_forward's copy, which it then replaces by the user's own
                        model.forward = old
                    else:
                        del model.forward
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, KilnError):
            raise inner from None
        raise
    finally:
        _listeners.remove(listen)
        dynamo_log.removeHandler(limits)
    report = ExplainReport(reports, baselines=tuple(baselines), limits=limits.hits)
    if timing:
        for g, what in zip(reports, compiled, strict=True):
            if what.last_args is not None:
                report.timings[g.index] = time_graph(g, what, what.last_args, iters, tuple(baselines))
    return report
