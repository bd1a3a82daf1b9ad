"""The pass driver: which passes run, in what order, and the checks between them.

A pass is a function `gm -> PassResult(gm, modified)` in its own file under passes/, exposed as `PASS`.
`build_pipeline` picks passes from one of two literal lists, MODEL_PIPELINE and STEP_PIPELINE (adjusted by the
spec's compile part and CLI overrides), and checks each pass comes after the ones it requires; `run_pipeline`
runs them.
After every pass that changed the graph, FakeTensor propagation refreshes node.meta["val"] so later
passes can read shapes. In debug mode (KILN_DEBUG=1) every pass is also followed by graph.lint(),
gm.recompile(), an IR check and a check that `modified` told the truth; any failure raises PassError
naming the pass and the passes before it. KILN_DUMP_DIR (or dump_dir) gets the graph after every pass.
"""

from __future__ import annotations

import importlib
import operator
import os
import pkgutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.* Level-1 ops)
import kiln.ir.ops_level2  # noqa: F401  (registers the Level-2 ops)
import kiln.ir.ops_mod  # noqa: F401  (registers the Mixture-of-Depths ops)
import kiln.passes
from kiln import env
from kiln.errors import InternalError, KilnError, PassError
from kiln.ir.registry import unbind_references
from kiln.ir.text import format_graph
from kiln.model_config import CompileConfig
from kiln.passes.base import Pass, PassResult
from kiln.passes.flash_tiling import make_pass as flash_tiling_pass
from kiln.passes.kv_cache import make_pass as kv_cache_pass
from kiln.passes.quantize import make_pass as quantize_pass

# The pipelines, as literal lists in the order they run. A pass that is not asked for is skipped (quantize
# runs only when the compile config names a scheme; kv_cache only in the step graph); the order never changes.
MODEL_PIPELINE: tuple[str, ...] = (
    "mod_routing", "gqa_fusion", "quantize", "rope_fusion", "norm_fusion", "flash_tiling",
)
STEP_PIPELINE: tuple[str, ...] = (
    "mod_routing", "gqa_fusion", "quantize", "rope_fusion", "kv_cache", "norm_fusion", "flash_tiling",
)
# What runs when nothing is asked for: the model pipeline less the passes that need a setting (mod_routing runs
# for a Mixture-of-Depths model: spec validation records its ModConfig as CompileConfig.extra["route"]).
_NEEDS_SETTING = ("quantize", "mod_routing")
DEFAULT_PIPELINE: tuple[str, ...] = tuple(n for n in MODEL_PIPELINE if n not in _NEEDS_SETTING)
# CompileConfig.extra key: the tokenizer a GPTQ scheme's calibration file is encoded with. kiln.build.load_model sets
# the model's own, so every path that compiles a loaded model (LLM, run, serve, bench) calibrates on its tokens;
# without it the quantize pass encodes the file as bytes (the tokens of a model that has no tokenizer).
CALIBRATION_TOKENIZER = "calibration_tokenizer"

# torch (non-kiln) call targets a Level-1/Level-2 graph may hold.
ALLOWED_TORCH_TARGETS: frozenset = frozenset(
    {
        operator.getitem,
        torch.ops.aten.split_with_sizes.default,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.index_select.default,  # kv_cache: the sampled rows before the lm_head
    }
)

_registry: dict[str, Pass] | None = None


def known_passes() -> dict[str, Pass]:
    """Every pass in kiln.passes: each module there that defines `PASS`, keyed by the pass name."""
    global _registry
    if _registry is None:
        pkg = kiln.passes
        found: dict[str, Pass] = {}
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            p = getattr(module, "PASS", None)
            if isinstance(p, Pass):
                found[p.name] = p
        _registry = found
    return dict(_registry)


def check_order(passes: Sequence[Pass]) -> None:
    """PassError unless every pass comes after the passes it requires (a list given in a compile config is
    checked, never reordered: the order written is the order run)."""
    seen: set[str] = set()
    names = [p.name for p in passes]
    for p in passes:
        for req in p.requires:
            if req not in names:
                raise PassError(
                    f"pass {p.name!r} requires pass {req!r}, which is not in the pipeline "
                    f"({', '.join(names)}); enable {req!r} or disable {p.name!r}"
                )
            if req not in seen:
                raise PassError(
                    f"pass {p.name!r} requires pass {req!r} to run before it, but the pipeline runs "
                    f"{' -> '.join(names)}; put {req!r} first"
                )
        seen.add(p.name)


def build_pipeline(
    compile_cfg: CompileConfig | None = None,
    overrides: Mapping[str, bool] | None = None,
    *,
    step: bool = False,
    kv_dtype: str = "auto",
    registry: Mapping[str, Pass] | None = None,
) -> list[Pass]:
    """The passes to run, in order: MODEL_PIPELINE (or STEP_PIPELINE for the serving step graph, its kv_cache
    pass bound to `kv_dtype`), or `compile_cfg.extra["passes"]` (a list of names, run in the order given).

    `compile_cfg.extra["quantize"]` (a scheme, see kiln.quant.formats) binds the quantize pass to it (without it
    quantize is skipped unless a list or an override names it), with `extra[CALIBRATION_TOKENIZER]` encoding a GPTQ
    calibration file; `extra["route"]` (a Mixture-of-Depths model's ModConfig, recorded by spec validation) turns
    mod_routing on; `extra["attention"]` (the spec's `attention = ...`) turns flash_tiling off (reference) or pins
    its tile; `extra["disable_passes"]` drops names; `overrides`
    (CLI flags) map a pass name to True (run it) or False (skip it) and win over the config. Every pass must come
    after the passes it `requires`: checked, never reordered.
    """
    registry = dict(known_passes() if registry is None else registry)
    extra = compile_cfg.extra if compile_cfg is not None else {}
    full = STEP_PIPELINE if step else MODEL_PIPELINE
    names = list(extra.get("passes", full))
    on = {n: True for n in names}
    if "passes" not in extra:
        on["quantize"] = bool(extra.get("quantize"))
        on["mod_routing"] = bool(extra.get("route"))
    if extra.get("quantize"):
        registry["quantize"] = quantize_pass(extra["quantize"], tokenizer=extra.get(CALIBRATION_TOKENIZER))
    if step:
        registry["kv_cache"] = kv_cache_pass(kv_dtype)
    attention = extra.get("attention") or {}
    if attention.get("kind") == "reference":  # attention stays kiln::attention: the reference op / default kernel
        on["flash_tiling"] = False
    elif attention.get("tile"):
        registry["flash_tiling"] = flash_tiling_pass(attention["tile"])
    on |= {n: False for n in extra.get("disable_passes", ())} | dict(overrides or {})
    unknown = sorted(n for n in on if n not in registry)
    if unknown:
        raise PassError(f"unknown pass(es) {', '.join(unknown)}; known passes: {', '.join(sorted(registry))}")
    order = names + [n for n in full if n not in names] + [n for n in on if n not in full and n not in names]
    chosen = [registry[n] for n in order if on.get(n)]
    check_order(chosen)
    return chosen


# ---- running ----------------------------------------------------------------------------------------------


def propagate(gm: fx.GraphModule) -> fx.GraphModule:
    """Refill node.meta["val"] with FakeTensors shaped like the inputs' current meta (computes nothing)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = []
        for n in placeholders:
            val = n.meta.get("val")
            if isinstance(val, (int, float, bool)):  # host-side scalars (the step graph's max_query_len, ...)
                inputs.append(val)
                continue
            if not isinstance(val, torch.Tensor):
                raise PassError(f"input {n.name} has no example value (meta['val']); build the graph with the frontend")
            inputs.append(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return gm


def _is_kiln_op(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "kiln"


def check_ir(gm: fx.GraphModule) -> None:
    """Raise IRCheckError unless every call is a kiln op or an allowed torch op, every node has meta['val']
    and no computed node is dead."""
    problems = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and not (_is_kiln_op(n.target) or n.target in ALLOWED_TORCH_TARGETS):
            problems.append(f"%{n.name} calls {n.target}, which is neither a kiln op nor an allowed torch op")
        elif n.op in ("call_module", "call_method"):
            problems.append(f"%{n.name} is a {n.op} node; kiln graphs hold call_function nodes only")
        if n.op != "output" and "val" not in n.meta:
            problems.append(f"%{n.name} has no meta['val']")
        if n.op in ("call_function", "get_attr") and not n.users:
            problems.append(f"%{n.name} is dead (no users)")
    if problems:
        raise IRCheckError("IR check failed:\n  " + "\n  ".join(problems))


def _check(gm: fx.GraphModule, before_text: str, result: PassResult) -> None:
    gm.graph.lint()
    gm.recompile()
    changed = str(gm.graph) != before_text
    if changed != result.modified:
        did = "did" if changed else "did not"
        raise IRCheckError(f"reported modified={result.modified} but the graph {did} change")
    propagate(gm)
    check_ir(gm)


def _dump(dump_dir: Path, index: int, name: str, gm: fx.GraphModule) -> None:
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / f"{index:02d}_{name}.txt").write_text(format_graph(gm, title=f"after {name}" if index else name))


def _after(done: list[str]) -> str:
    return f" (after {', '.join(done)})" if done else " (the first pass)"


class IRCheckError(AssertionError):
    """A pass left the graph broken (debug checks); run_pipeline reports it as an InternalError."""


def run_pipeline(
    gm: fx.GraphModule,
    passes: Iterable[Pass],
    *,
    debug: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
) -> fx.GraphModule:
    """Run `passes` over `gm` in order (it is changed in place and returned)."""
    debug = env.debug() if debug is None else debug
    dump_dir = dump_dir if dump_dir is not None else env.dump_dir()
    dump_path = Path(dump_dir) if dump_dir is not None else None
    unbind_references(gm)  # a graph that ran without kernels before: its ops back, with their fake kernels
    if any(n.op != "output" and "val" not in n.meta for n in gm.graph.nodes):
        # Passes read meta["val"], refreshed below only after a pass that changed the graph; fill it for a
        # graph built without it, or the first pass that reads it fails whenever no pass before it changed.
        gm.recompile()
        propagate(gm)
    if dump_path is not None:
        _dump(dump_path, 0, "input", gm)
    done: list[str] = []
    for i, p in enumerate(passes, start=1):
        before = str(gm.graph) if debug else ""
        try:
            result = p.run(gm)
            gm = result.gm
            if debug:
                _check(gm, before, result)
            elif result.modified:
                gm.recompile()
                propagate(gm)
        except KilnError as e:  # the user's input (a spec value, a weight shape): one message, no traceback
            raise PassError(f"pass {p.name!r} failed{_after(done)}: {e}") from e
        except Exception as e:  # anything else is kiln's own fault: keep the traceback (chained) and say so
            raise InternalError(f"pass {p.name!r} failed{_after(done)}: {type(e).__name__}: {e}") from e
        done.append(p.name)
        if dump_path is not None:
            _dump(dump_path, i, p.name, gm)
    return gm


def passes_before_quantize(route: bool) -> tuple[str, ...]:
    """The passes the pipelines run before quantize: mod_routing for a Mixture-of-Depths model (`route`), gqa_fusion.
    A quantized checkpoint is written and loaded after exactly these, so that its weights are the ones the pipeline
    quantizes (fused as it fuses them, calibrated on what it computes)."""
    before = MODEL_PIPELINE[: MODEL_PIPELINE.index("quantize")]
    return tuple(n for n in before if n != "mod_routing" or route)


def quantize_graph(gm: fx.GraphModule, scheme, *, route: bool | None = None, **kwargs) -> fx.GraphModule:
    """The pipeline's passes before quantize (passes_before_quantize; those already run change nothing), then
    quantize, in place; scheme and kwargs as kiln.passes.quantize.make_pass. route: the graph is a
    Mixture-of-Depths model's, routed (mod_routing) first as the pipeline does (None: when the graph has routed
    layers). gm.meta["kiln_passes_before_quantize"] records the passes before quantize (save_quantized stores them)."""
    if route is None:  # bench quality / perplexity hand a graph alone: GPTQ then calibrates on what serving computes
        route = any(n.target is torch.ops.kiln.mod_combine.default for n in gm.graph.nodes)
    known = known_passes()
    before = passes_before_quantize(route)
    gm = run_pipeline(gm, [known[n] for n in before] + [quantize_pass(scheme, **kwargs)])
    gm.meta["kiln_passes_before_quantize"] = list(before)
    return gm
