"""The public compile API: Level-1 graph -> passes -> lowered graph with generated kernels.

    compiled = compile_model(build_graph(cfg))          # the pipeline from CompileConfig, kernels when usable
    logits = compiled(tokens, positions)                # like the GraphModule
    emit(build_graph(cfg, device="meta"), "out/")      # graphs after every pass + every kernel's source

Kernels are used when `use_kernels` is true, by default when CUDA is available or TRITON_INTERPRET=1 (the
CPU interpreter). Without them the passed graph runs on the ops' reference implementations.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from kiln import env
from kiln.codegen.cache import default_cache
from kiln.codegen.render import render
from kiln.compile.kernel_requests import KernelRequest, kernel_requests
from kiln.compile.lowering import lower
from kiln.compile.pipeline import build_pipeline, run_pipeline
from kiln.errors import KilnError
from kiln.ir.text import format_graph
from kiln.model_config import CompileConfig
from kiln.progress import KERNEL_PROGRESS_MIN

_HEADER_NODES = 4  # nodes listed in an emitted kernel's header


@dataclass
class KernelStats:
    hits: int = 0  # kernels found already rendered and imported in this process
    misses: int = 0  # kernels rendered (and written / imported) by this compile


@dataclass
class CompiledModel:
    gm: fx.GraphModule  # the lowered graph (kernel calls), or the passed graph when use_kernels is False
    passes: list[str]
    use_kernels: bool
    kernels: list[KernelRequest] = field(default_factory=list)
    stats: KernelStats = field(default_factory=KernelStats)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.gm(tokens, positions)

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses


def kernels_usable() -> bool:
    return torch.cuda.is_available() or env.triton_interpret()


def resolve_use_kernels(use_kernels: bool | None, name: str = "use_kernels") -> bool:
    """use_kernels as given (None: kernels_usable()); True where kernels cannot run is refused now, naming `name`,
    rather than Triton's "0 active drivers" at the first call."""
    if use_kernels is None:
        return kernels_usable()
    if use_kernels and not kernels_usable():
        raise KilnError(
            f"{name}=True needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is "
            f"imported), and this process has neither; leave {name} out (or False) to run kiln's reference ops"
        )
    return bool(use_kernels)


def _passed(
    gm: fx.GraphModule, compile_cfg: CompileConfig | None, overrides: dict[str, bool] | None, dump_dir
) -> tuple[fx.GraphModule, list[str]]:
    passes = build_pipeline(compile_cfg, overrides)
    return run_pipeline(gm, passes, dump_dir=dump_dir), [p.name for p in passes]


def _load(requests: list[KernelRequest]) -> KernelStats:
    from tqdm import tqdm


    cache = default_cache()
    before = (cache.stats.hits, cache.stats.misses)
    for req in tqdm(requests, desc="kiln: kernels", unit="kernel", disable=len(requests) < KERNEL_PROGRESS_MIN):
        cache.load(req.template, req.name, **req.params)
    return KernelStats(cache.stats.hits - before[0], cache.stats.misses - before[1])


def compile_model(
    gm: fx.GraphModule,
    compile_cfg: CompileConfig | None = None,
    *,
    device: str | torch.device | None = None,
    use_kernels: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
    overrides: dict[str, bool] | None = None,
) -> CompiledModel:
    """Run the pass pipeline over `gm` (changed in place: fused weights replace the originals) and lower it.

    device: move the graph's weights there first (default: where they are). use_kernels: lower to the
    generated kernels and load every kernel now (default: kernels_usable()). dump_dir / KILN_DUMP_DIR: the
    graph after every pass, plus the lowered graph. overrides: pass name -> on/off (CLI flags).
    """
    if device is not None:
        gm = gm.to(device)
    use_kernels = resolve_use_kernels(use_kernels)
    gm, names = _passed(gm, compile_cfg, overrides, dump_dir)
    if not use_kernels:
        return CompiledModel(gm, names, use_kernels=False)
    lowered = lower(gm)
    requests = kernel_requests(lowered)
    stats = _load(requests)
    dump = dump_dir if dump_dir is not None else env.dump_dir()
    if dump:
        path = Path(dump) / f"{len(names) + 1:02d}_lowered.txt"
        path.write_text(format_graph(lowered, title="lowered (kernel calls)"))
    return CompiledModel(lowered, names, use_kernels=True, kernels=requests, stats=stats)


def _kernel_file_name(index: int, req: KernelRequest) -> str:
    op = str(req.params.get("op", req.name))
    return f"{index:02d}_{req.template}_{re.sub(r'[^A-Za-z0-9_]+', '_', op)}.py"


def kernel_source(req: KernelRequest) -> str:
    """The rendered kernel with a header naming the graph nodes that launch it (op, shapes, dtypes)."""
    lines = [
        "# kiln emit: launched by (shapes and dtypes at the example input; the kernel is shape-generic",
        "# apart from the constexprs in the header below):",
    ]
    lines += [f"#   {line}" for line in req.nodes[:_HEADER_NODES]]
    if len(req.nodes) > _HEADER_NODES:
        lines.append(f"#   ... and {len(req.nodes) - _HEADER_NODES} more node(s)")
    return "\n".join(lines) + "\n" + render(req.template, name=req.name, **req.params)


def emit(
    gm: fx.GraphModule,
    out_dir: str | os.PathLike,
    compile_cfg: CompileConfig | None = None,
    *,
    overrides: dict[str, bool] | None = None,
) -> list[Path]:
    """Write out_dir/graphs/NN_<pass>.txt (the graph after every pass, then the lowered graph) and
    out_dir/kernels/NN_<family>_<op>.py (every generated kernel's source with a header); returns the paths.

    Works on meta-device graphs (nothing is computed or loaded): the kernels are the ones a GPU would run.
    """
    out = Path(out_dir)
    graphs, kernels = out / "graphs", out / "kernels"
    gm, names = _passed(gm, compile_cfg, overrides, graphs)
    lowered = lower(gm)
    (graphs / f"{len(names) + 1:02d}_lowered.txt").write_text(format_graph(lowered, title="lowered (kernel calls)"))
    kernels.mkdir(parents=True, exist_ok=True)
    written = sorted(graphs.glob("*.txt"))
    for i, req in enumerate(kernel_requests(lowered)):
        path = kernels / _kernel_file_name(i, req)
        path.write_text(kernel_source(req))
        written.append(path)
    return written
