"""compile_step: a Level-1 graph -> the runtime's step model (kiln.step.StepModel) over a paged KV cache.

    model = compile_step(build_graph(cfg), cfg)               # kv_cache pass + the default passes, kernels
    cache = allocate_kv_cache(model, num_blocks=64, block_size=16)   # a KVCache (data, int8 scales or None)
    logits = model(batch, cache)                              # fp32 [R, vocab]; the batch's K/V now cached

The kv_cache pass (passes/kv_cache.py) makes the step graph; the other passes of the compile config's
pipeline run around it in the order of kiln.compile.pipeline.STEP_PIPELINE: gqa_fusion and rope_fusion before
it (gqa_fusion only fuses projections that feed kiln::attention), norm_fusion after it (so the gathered final
add + norm still fuse), flash_tiling last (it then finds no attention left). With kernels (default: CUDA or
TRITON_INTERPRET=1) the graph is lowered to the generated kernels, paged attention included (codegen/paged.py).

The spec's `kv_cache = paged(block = 16, dtype = int8)` (CompileConfig.extra["kv_cache"]) sets the cache dtype
(kv_cache_dtype overrides it) and the model's preferred block_size (the engine's default pool block size); a
fixed `attention = flash(block_m = ...)` tile is also the paged prefill kernel's tile.

A Mixture-of-Depths model (cfg.route) runs mod_routing first and gets the routed KV cache (passes/kv_cache.py):
the step model has num_routed_layers > 0 (num_layers counts the dense layers), needs KVCache.routed and the
StepBatch's routed_lens / routed_block_tables, and returns (logits, routed rows per routed layer). An int8 KV
cache is refused for it.

`model.verify` (a kiln.step.Verifier) is speculative decoding's verification, bound by the same rule as the
graph: kiln::spec_verify's generated kernel (codegen/spec_verify.py, loaded now) with kernels, else the op itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

import kiln.ir.ops_paged  # noqa: F401  (registers kiln::paged_attention)
import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify)
from kiln.codegen import spec_verify as spec_verify_kernel
from kiln.codegen._host import BoundKernels, recording
from kiln.codegen.cache import default_cache
from kiln.compile.driver import resolve_use_kernels
from kiln.compile.kernel_requests import kernel_requests
from kiln.compile.lowering import k_spec_verify, lower
from kiln.compile.pipeline import build_pipeline, run_pipeline
from kiln.errors import KilnError, PassError
from kiln.ir.registry import bind_references
from kiln.model_config import CompileConfig, ModelConfig
from kiln.step import KV_CACHE, ROUTED_KV_CACHE, KVCache, StepBatch, Verifier, VerifyBatch
from kiln.step import allocate_kv_cache as _allocate


@dataclass
class BatchVerifier:
    """A kiln.step.Verifier over `fn`, which has kiln::spec_verify's signature (the op, or its kernel's wrapper)."""

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def __call__(self, batch: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(batch.target_probs, batch.draft_tokens, batch.draft_probs, batch.num_drafts, batch.uniforms,
                       batch.noise)  # fmt: skip


def make_verifier(vocab: int, use_kernels: bool) -> BatchVerifier:
    """kiln::spec_verify for a `vocab`-wide model: its reference op, or (use_kernels) its kernel, whose two
    instances (with and without draft_probs) are rendered and imported now rather than on the first verify."""
    if not use_kernels:
        return BatchVerifier(torch.ops.kiln.spec_verify.default)
    requests: list[tuple[str, str, dict]] = []
    meta = {"device": "meta"}
    with recording(lambda template, name, args, **params: requests.append((template, name, params))):
        for draft_probs in (torch.empty(1, 1, vocab, **meta), None):
            spec_verify_kernel.spec_verify(
                torch.empty(1, 2, vocab, **meta), torch.empty(1, 1, dtype=torch.int64, **meta), draft_probs,
                torch.empty(1, dtype=torch.int32, **meta), torch.empty(1, 1, **meta), torch.empty(1, vocab, **meta),
            )  # fmt: skip
    for template, name, params in requests:
        default_cache().load(template, name, **params)
    # Checked on every call: the runtime builds these tensors, no fake propagation has vetted them.
    return BatchVerifier(BoundKernels(k_spec_verify, checked=True))


@dataclass
class CompiledStep:
    """A kiln.step.StepModel: one call runs one scheduler step over a flat batch."""

    gm: fx.GraphModule  # the step graph, lowered to kernel calls when use_kernels
    num_layers: int  # cache layers: one per attention node
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype: torch.dtype
    device: torch.device
    use_kernels: bool
    passes: list[str] = field(default_factory=list)
    kv_dtype: torch.dtype | None = None  # the cache's element type: dtype (None means so) or torch.int8
    block_size: int = 16  # the pool block size the compile config asks for; the engine's default
    verify: Verifier | None = None  # speculative decoding's verification (None: the reference op)
    num_routed_layers: int = 0  # Mixture-of-Depths: routed layers, cached in KVCache.routed (num_layers: dense)
    routed_capacity: float = 1.0  # the share of tokens a routed layer is expected to keep (sizes its pool)

    def __post_init__(self) -> None:
        self.kv_dtype = self.kv_dtype or self.dtype
        if self.verify is None:
            self.verify = make_verifier(self.vocab, use_kernels=False)

    def _check_cache(self, cache: KVCache) -> None:
        routed = cache.routed
        want_routed = (self.num_routed_layers, 2, self.num_kv_heads, self.head_dim)
        got_routed = None if routed is None else (*routed.shape[:2], *routed.shape[4:]) if routed.dim() == 6 else ()
        if (want_routed if self.num_routed_layers else None) != got_routed or (
                routed is not None and (routed.dtype != self.kv_dtype or routed.shape[3] != cache.data.shape[3])):
            raise KilnError(
                f"kv_cache.routed is {None if routed is None else (tuple(routed.shape), routed.dtype)}; this model has "
                f"{self.num_routed_layers} routed layers and needs "
                + (f"[{self.num_routed_layers}, 2, routed_blocks, block_size, {self.num_kv_heads}, {self.head_dim}] "
                   f"in {self.kv_dtype} with the dense pool's block size" if self.num_routed_layers else "none")
                + ": allocate it with kiln.compile.step.allocate_kv_cache"
            )
        data, scales = cache.data, cache.scales
        want = (self.num_layers, 2, self.num_kv_heads, self.head_dim)
        got = (*data.shape[:2], *data.shape[4:]) if data.dim() == 6 else tuple(data.shape)
        quantized = self.kv_dtype == torch.int8
        bad_scales = (scales is None or scales.shape != data.shape[:-1] or scales.dtype != torch.float32
                      if quantized else scales is not None)  # fmt: skip
        if got != want or data.dtype != self.kv_dtype or bad_scales:
            scales_note = f" with fp32 scales {list(data.shape[:-1])}" if quantized else " and no scales"
            raise KilnError(
                f"kv_cache has shape {tuple(data.shape)} and dtype {data.dtype}"
                f"{'' if scales is None else f', scales {tuple(scales.shape)} {scales.dtype}'}; this model needs "
                f"[{self.num_layers}, 2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}] in "
                f"{self.kv_dtype}{scales_note}: allocate it with kiln.compile.step.allocate_kv_cache"
            )

    def __call__(self, batch: StepBatch, kv_cache: KVCache | torch.Tensor
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [R, vocab] in the model's dtype for batch.sample_indices; writes the batch's K/V into kv_cache (a
        KVCache, or the bare data tensor of a cache in the model's dtype). A routed model returns (logits, routed int32
        [num_routed_layers, N]: 1 where a routed layer routed the flat batch's row) and needs batch.routed_lens /
        routed_block_tables and kv_cache.routed."""
        cache = kv_cache if isinstance(kv_cache, KVCache) else KVCache(kv_cache)
        self._check_cache(cache)
        if self.num_routed_layers and (batch.routed_lens is None or batch.routed_block_tables is None):
            raise KilnError("this model has routed (Mixture-of-Depths) layers: its StepBatch needs routed_lens and "
                            "routed_block_tables (kiln.runtime's ModelRunner builds them)")
        inputs = batch.graph_inputs(cache)
        with torch.no_grad():
            out = self.gm(**inputs)
        # In the model's dtype: the runner takes the sampled rows to fp32; prompt-scoring rows (prompt_logprobs)
        # go to fp32 a block at a time, so a long prompt's [tokens, vocab] logits never exist in fp32 whole.
        if not self.num_routed_layers:
            return out.reshape(-1, self.vocab)
        logits, *routed = out
        return logits.reshape(-1, self.vocab), torch.stack(routed)


def _pin_paged_tile(gm: fx.GraphModule, tile: dict) -> None:
    """Give every lowered paged-attention call the spec's fixed flash tile (its prefill kernel's tile)."""
    fields = (tile["block_m"], tile["block_n"], tile["num_warps"], tile["num_stages"])
    for node in gm.graph.nodes:
        if node.meta.get("kiln_op") == str(torch.ops.kiln.paged_attention.default):
            node.kwargs = {**node.kwargs, "tile": fields}
    gm.recompile()


def compile_step(
    gm: fx.GraphModule,
    cfg: ModelConfig,
    compile_cfg: CompileConfig | None = None,
    *,
    device: str | torch.device | None = None,
    use_kernels: bool | None = None,
    dump_dir: str | os.PathLike | None = None,
    kv_cache_dtype: str | None = None,
) -> CompiledStep:
    """Turn a Level-1 graph of `cfg` (from kiln.ir.frontend.build_graph; changed in place) into a step model.

    device: move the weights there first. use_kernels: lower to generated kernels (default: kernels_usable(),
    i.e. CUDA or TRITON_INTERPRET=1) and load them now; otherwise the ops' reference implementations run.
    dump_dir / KILN_DUMP_DIR: the graph after every pass. kv_cache_dtype: "auto" (the model's dtype) or "int8"
    (per token and head scales); None: the compile config's `kv_cache = paged(dtype = ...)`, else auto.
    """
    kv_request = kv_cache_dtype or ((compile_cfg.extra.get("kv_cache") or {}) if compile_cfg else {}).get("dtype")
    if cfg.route is not None and kv_request == "int8":
        raise KilnError(
            f"model {cfg.name!r} routes layers with Mixture-of-Depths, and an int8 KV cache is not built for the "
            "routed KV cache yet; serve it with kv_cache = paged(dtype = auto) (--kv-cache-dtype auto)"
        )
    if device is not None:
        gm = gm.to(device)
    use_kernels = resolve_use_kernels(use_kernels)
    extra = compile_cfg.extra if compile_cfg is not None else {}
    kv_spec = extra.get("kv_cache") or {}
    passes = build_pipeline(compile_cfg, step=True, kv_dtype=kv_cache_dtype or kv_spec.get("dtype", "auto"))
    gm = run_pipeline(gm, passes, dump_dir=dump_dir)
    cache = gm.graph.find_nodes(op="placeholder", target=KV_CACHE)
    if not cache:
        raise PassError(f"model {cfg.name!r} has no attention, so there is no KV cache to page")
    routed_cache = gm.graph.find_nodes(op="placeholder", target=ROUTED_KV_CACHE)
    if (cfg.route is not None) != bool(routed_cache):  # e.g. mod_routing disabled: never serve it as dense
        raise PassError(
            f"model {cfg.name!r}: the step graph {'has' if routed_cache else 'has no'} routed KV cache but the model "
            f"{'has no' if cfg.route is None else 'has'} Mixture-of-Depths routing; keep the mod_routing pass on"
        )
    _, _, _, _, kv_heads, head_dim = cache[0].meta["val"].shape
    num_layers = cache[0].meta["val"].shape[0]
    num_routed = routed_cache[0].meta["val"].shape[0] if routed_cache else 0
    kv_dtype = cache[0].meta["val"].dtype
    paged = next(n for n in gm.graph.nodes if n.target is torch.ops.kiln.paged_attention.default)
    dtype = paged.args[0].meta["val"].dtype  # a paged_attention's q: the activations' dtype
    ref = next(iter(gm.parameters()), None)
    model_device = ref.device if ref is not None else torch.device("cpu")
    if use_kernels:
        gm = lower(gm)
        tile = (extra.get("attention") or {}).get("tile")
        if tile:
            _pin_paged_tile(gm, tile)
        # Render and import every kernel now, not on the first step: for a prefill step and for a decode step.
        bound = gm.graph.find_nodes(op="placeholder", target="max_query_len")[0]
        example = bound.meta["val"]
        for max_query_len in (example, 1):
            bound.meta["val"] = max_query_len
            for req in kernel_requests(gm):
                default_cache().load(req.template, req.name, **req.params)
        bound.meta["val"] = example
    else:  # the reference ops, called directly: no per-op dispatcher work on the CPU decode path
        gm = bind_references(gm)
    return CompiledStep(gm, num_layers, kv_heads, head_dim, cfg.vocab, dtype, model_device, use_kernels,
                        [p.name for p in passes], kv_dtype, kv_spec.get("block", 16),
                        make_verifier(cfg.vocab, use_kernels), num_routed,
                        cfg.route.capacity if cfg.route is not None else 1.0)  # fmt: skip


def allocate_kv_cache(model: CompiledStep, num_blocks: int, block_size: int,
                      routed_num_blocks: int | None = None) -> KVCache:
    """A zeroed KVCache: data [layers, 2, num_blocks, block_size, kv_heads, head_dim] on the model's device in its
    kv_dtype, and fp32 scales [layers, 2, num_blocks, block_size, kv_heads] when that is int8; a routed model's
    routed layers get routed [routed_layers, 2, routed_num_blocks (default num_blocks), block_size, ...]."""
    return _allocate(model, num_blocks, block_size, routed_num_blocks)
