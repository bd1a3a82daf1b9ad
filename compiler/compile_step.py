"""compile_step: a Level-1 graph -> the runtime's step model (kiln.runtime.step.StepModel) over a paged KV cache.

    model = compile_step(build_graph(cfg), cfg)               # kv_cache pass + the default passes, kernels
    cache = allocate_kv_cache(model, num_blocks=64, block_size=16)
    logits = model(batch, cache)                              # fp32 [R, vocab]; the batch's K/V now cached

The kv_cache pass (passes/kv_cache.py) makes the step graph; the other passes of the compile config's
pipeline run around it in STEP_ORDER: gqa_fusion and rope_fusion before it (gqa_fusion only fuses projections
that feed kiln::attention), norm_fusion after it (so the gathered final add + norm still fuse), flash_tiling
last (it then finds no attention left). With kernels (default: CUDA or TRITON_INTERPRET=1) the graph is
lowered to the generated kernels, paged attention included (codegen/paged.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import fx

import kiln.ops_paged  # noqa: F401  (registers kiln::paged_attention)
from kiln.compile import kernels_usable
from kiln.errors import KilnError, PassError
from kiln.model_config import CompileConfig, ModelConfig
from kiln.pipeline import build_pipeline, known_passes, order_passes, run_pipeline
from kiln.runtime.step import StepBatch, kv_cache_shape

STEP_ORDER = ("gqa_fusion", "quantize", "rope_fusion", "kv_cache", "norm_fusion", "flash_tiling")


@dataclass
class CompiledStep:
    """A kiln.runtime.step.StepModel: one call runs one scheduler step over a flat batch."""

    gm: fx.GraphModule  # the step graph, lowered to kernel calls when use_kernels
    num_layers: int  # cache layers: one per attention node
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype: torch.dtype
    device: torch.device
    use_kernels: bool
    passes: list[str] = field(default_factory=list)

    def __call__(self, batch: StepBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, vocab] for batch.sample_indices; writes the batch's K/V into kv_cache."""
        want = (self.num_layers, 2, self.num_kv_heads, self.head_dim)
        got = (*kv_cache.shape[:2], *kv_cache.shape[4:]) if kv_cache.dim() == 6 else tuple(kv_cache.shape)
        if got != want or kv_cache.dtype != self.dtype:
            raise KilnError(
                f"kv_cache has shape {tuple(kv_cache.shape)} and dtype {kv_cache.dtype}; this model needs "
                f"[{self.num_layers}, 2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}] in "
                f"{self.dtype}: allocate it with kiln.compile_step.allocate_kv_cache"
            )
        with torch.no_grad():
            logits = self.gm(
                batch.tokens.view(1, -1), batch.positions.view(1, -1), batch.slot_mapping, batch.block_tables,
                batch.context_lens, batch.query_start_loc, batch.sample_indices, kv_cache,
                int(batch.max_query_len), int(batch.max_context_len),
            )  # fmt: skip
        return logits.reshape(-1, self.vocab).float()


def _step_passes(compile_cfg: CompileConfig | None) -> list:
    passes = build_pipeline(compile_cfg)
    names = [p.name for p in passes]
    if "kv_cache" not in names:
        passes.append(known_passes()["kv_cache"])
    preferred = dict.fromkeys((*STEP_ORDER, *names))  # first mention wins: order_passes ranks by index
    return order_passes(passes, preferred=tuple(preferred))


def compile_step(
    gm: fx.GraphModule,
    cfg: ModelConfig,
    compile_cfg: CompileConfig | None = None,
    *,
    device: str | torch.device | None = None,
    use_kernels: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
) -> CompiledStep:
    """Turn a Level-1 graph of `cfg` (from kiln.frontend.build_graph; changed in place) into a step model.

    device: move the weights there first. use_kernels: lower to generated kernels (default: kernels_usable(),
    i.e. CUDA or TRITON_INTERPRET=1) and load them now; otherwise the ops' reference implementations run.
    dump_dir / KILN_DUMP_DIR: the graph after every pass.
    """
    if device is not None:
        gm = gm.to(device)
    use_kernels = kernels_usable() if use_kernels is None else use_kernels
    passes = _step_passes(compile_cfg)
    gm = run_pipeline(gm, passes, dump_dir=dump_dir)
    cache = gm.graph.find_nodes(op="placeholder", target="kv_cache")
    if not cache:
        raise PassError(f"model {cfg.name!r} has no attention, so there is no KV cache to page")
    _, _, _, _, kv_heads, head_dim = cache[0].meta["val"].shape
    num_layers = cache[0].meta["val"].shape[0]
    dtype = cache[0].meta["val"].dtype
    ref = next(iter(gm.parameters()), None)
    model_device = ref.device if ref is not None else torch.device("cpu")
    if use_kernels:
        from kiln.codegen.cache import default_cache
        from kiln.lowering import kernel_requests, lower

        gm = lower(gm)
        # Render and import every kernel now, not on the first step: for a prefill step and for a decode step.
        bound = gm.graph.find_nodes(op="placeholder", target="max_query_len")[0]
        example = bound.meta["val"]
        for max_query_len in (example, 1):
            bound.meta["val"] = max_query_len
            for req in kernel_requests(gm):
                default_cache().load(req.template, req.name, **req.params)
        bound.meta["val"] = example
    return CompiledStep(gm, num_layers, kv_heads, head_dim, cfg.vocab, dtype, model_device, use_kernels,
                        [p.name for p in passes])  # fmt: skip


def allocate_kv_cache(model: CompiledStep, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] on the model's device and dtype."""
    return torch.zeros(kv_cache_shape(model, num_blocks, block_size), dtype=model.dtype, device=model.device)
