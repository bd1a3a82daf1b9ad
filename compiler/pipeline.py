"""The pass driver: which passes run, in what order, and the checks between them.

A pass is a function `gm -> PassResult(gm, modified)` in its own file under passes/, exposed as `PASS`.
`build_pipeline` picks passes from the default list (adjusted by the spec's compile part and CLI
overrides) and orders them with networkx from their declared requirements; `run_pipeline` runs them.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.* Level-1 ops)
import kiln.ops_level2  # noqa: F401  (registers the Level-2 ops)
from kiln.errors import PassError
from kiln.ir_text import format_graph
from kiln.model_config import CompileConfig


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool


@dataclass(frozen=True)
class Pass:
    """A named graph rewrite. `run` edits gm.graph (and gm's parameters) in place and says whether it changed
    anything; the driver recompiles and refreshes node.meta["val"] afterwards."""

    name: str
    run: Callable[[fx.GraphModule], PassResult]
    requires: tuple[str, ...] = ()  # passes that must run before this one (when both are in the pipeline)
    doc: str = ""


# The default pipeline, in its preferred order. Requirements can only move a pass later, never drop it.
DEFAULT_PIPELINE: tuple[str, ...] = (
    "gqa_fusion",
    "rope_fusion",
    "norm_fusion",
    "flash_tiling",
)

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
        import kiln.passes as pkg

        found: dict[str, Pass] = {}
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            p = getattr(module, "PASS", None)
            if isinstance(p, Pass):
                found[p.name] = p
        _registry = found
    return dict(_registry)


def order_passes(passes: Sequence[Pass], preferred: Sequence[str] = DEFAULT_PIPELINE) -> list[Pass]:
    """Topological order of `passes` by their requirements; ties keep `preferred` order, then given order.

    A requirement that is not among `passes` or a cycle among them raises PassError naming the passes.
    """
    by_name = {p.name: p for p in passes}
    graph = nx.DiGraph()
    graph.add_nodes_from(by_name)
    for p in passes:
        for req in p.requires:
            if req not in by_name:
                raise PassError(
                    f"pass {p.name!r} requires pass {req!r}, which is not in the pipeline "
                    f"({', '.join(by_name)}); enable {req!r} or disable {p.name!r}"
                )
            graph.add_edge(req, p.name)
    rank = {name: i for i, name in enumerate(preferred)}
    given = {p.name: i for i, p in enumerate(passes)}
    try:
        names = list(nx.lexicographical_topological_sort(graph, key=lambda n: (rank.get(n, len(rank)), given[n])))
    except nx.NetworkXUnfeasible:
        cycle = [u for u, _ in nx.find_cycle(graph)]
        raise PassError(
            f"pass requirements form a cycle: {' -> '.join(cycle + cycle[:1])}; drop one of these requirements"
        ) from None
    return [by_name[n] for n in names]


def build_pipeline(
    compile_cfg: CompileConfig | None = None,
    overrides: Mapping[str, bool] | None = None,
    *,
    registry: Mapping[str, Pass] | None = None,
) -> list[Pass]:
    """The ordered passes for a compile config.

    The starting list is DEFAULT_PIPELINE, or `compile_cfg.extra["passes"]` (a list of names) when given;
    `compile_cfg.extra["quantize"]` (a scheme, see kiln.quantization) adds the quantize pass bound to it;
    `compile_cfg.extra["attention"]` (the spec's `attention = ...`) turns flash_tiling off (reference) or pins its
    tile (flash with block_m / block_n / ...); `compile_cfg.extra["disable_passes"]` drops names; `overrides`
    (CLI flags) map a pass name to True (run it) or False (skip it) and win over the config.
    """
    registry = known_passes() if registry is None else registry
    extra = compile_cfg.extra if compile_cfg is not None else {}
    names = list(extra.get("passes", DEFAULT_PIPELINE))
    if extra.get("quantize"):  # the spec's `quantize = ...`: the pass joins, bound to that scheme, after gqa_fusion
        from kiln.passes.quantize import make_pass

        registry = {**registry, "quantize": make_pass(extra["quantize"])}
        if "quantize" not in names:
            names.insert(names.index("gqa_fusion") + 1 if "gqa_fusion" in names else 0, "quantize")
    attention = extra.get("attention") or {}
    off = {n: False for n in extra.get("disable_passes", ())}
    if attention.get("kind") == "reference":  # attention stays kiln::attention: the reference op / default kernel
        off["flash_tiling"] = False
    elif attention.get("tile"):
        from kiln.passes.flash_tiling import make_pass as tiled

        registry = {**registry, "flash_tiling": tiled(attention["tile"])}
    wanted = {n: True for n in names} | off | dict(overrides or {})
    unknown = sorted(n for n in wanted if n not in registry)
    if unknown:
        raise PassError(f"unknown pass(es) {', '.join(unknown)}; known passes: {', '.join(sorted(registry))}")
    chosen = [registry[n] for n, on in wanted.items() if on]
    return order_passes(chosen, preferred=names)


# ---- running ----------------------------------------------------------------------------------------------


def debug_enabled() -> bool:
    return os.environ.get("KILN_DEBUG", "") not in ("", "0")


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
    """Raise PassError unless every call is a kiln op or an allowed torch op, every node has meta['val']
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
        raise PassError("IR check failed:\n  " + "\n  ".join(problems))


def _check(gm: fx.GraphModule, before_text: str, result: PassResult) -> None:
    gm.graph.lint()
    gm.recompile()
    changed = str(gm.graph) != before_text
    if changed != result.modified:
        raise PassError(f"reported modified={result.modified} but the graph {'did' if changed else 'did not'} change")
    propagate(gm)
    check_ir(gm)


def _dump(dump_dir: Path, index: int, name: str, gm: fx.GraphModule) -> None:
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / f"{index:02d}_{name}.txt").write_text(format_graph(gm, title=f"after {name}" if index else name))


def run_pipeline(
    gm: fx.GraphModule,
    passes: Iterable[Pass],
    *,
    debug: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
) -> fx.GraphModule:
    """Run `passes` over `gm` in order (it is changed in place and returned)."""
    debug = debug_enabled() if debug is None else debug
    dump_dir = dump_dir if dump_dir is not None else os.environ.get("KILN_DUMP_DIR") or None
    dump_path = Path(dump_dir) if dump_dir is not None else None
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
        except Exception as e:
            after = f" (after {', '.join(done)})" if done else " (the first pass)"
            raise PassError(f"pass {p.name!r} failed{after}: {type(e).__name__}: {e}") from e
        done.append(p.name)
        if dump_path is not None:
            _dump(dump_path, i, p.name, gm)
    return gm
