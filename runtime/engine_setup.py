"""How an Engine is put together (runtime/engine.py's Engine is an EngineSetup, through engine_requests.py's
EngineRequests): the constructor's arguments checked (engine_args.py), the KV pool sized (kv_pool.py) and its block
manager made (make_block_manager: a BlockManager, or a RoutedBlockManager for a Mixture-of-Depths model, whose pools
pool_bytes weighs against caching every token), the scheduler, the model runner, a drafter bound to them, the output
side and the step in flight; and the two switches of when a step's output work is done, overlap_outputs and
async_scheduling, whose setters keep them consistent.
"""

from __future__ import annotations

import itertools
import logging

from kiln.errors import KilnError
from kiln.runtime.async_steps import AsyncSteps
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.engine_args import check_engine_args
from kiln.runtime.engine_stats import SpecCounters
from kiln.runtime.kv_pool import choose_num_blocks, routed_bytes_per_block, routed_pool_blocks
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.outputs import OutputMaker
from kiln.runtime.request import Request
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.spec_step import SpecStep
from kiln.runtime.speculative import DEFAULT_SPECULATION_MAX_BATCH, ModelDrafter, NgramDrafter
from kiln.step import (
    ModelLimits,
    StepModel,
    TokenizerLike,
    kv_bytes_per_block,
    kv_bytes_per_layer_block,
    num_routed_layers,
)

log = logging.getLogger("kiln.runtime")


class AsyncSchedulingError(KilnError):
    """async_scheduling asked for with what it is not built for: `conflict` is "speculation" (a drafter) or
    "overlap_outputs" (turned off). The message names the settings and gives the fix as Engine / LLM's arguments; an
    entry point that spells them otherwise (the CLI's flags) rewords it (advised), as PoolTooSmallError does."""

    def __init__(self, conflict: str, *, name: str = "async_scheduling", overlap: str = "overlap_outputs",
                 overlap_off: str = "overlap_outputs off", fix: str | None = None):
        self.conflict = conflict
        if conflict == "speculation":
            facts = (f"{name} is not built for speculative decoding (the drafter reads the last step's tokens on "
                     "the host)")
            fix = fix or f"leave {name} unset (or False)"
        else:
            facts = (f"{name} makes every output come one step later, as {overlap} does: it is not built with "
                     f"{overlap_off}")
            fix = fix or "leave one of them unset"
        super().__init__(f"{facts}; {fix}")

    def advised(self, name: str, overlap: str, overlap_off: str, fix: str) -> AsyncSchedulingError:
        """This error in an entry point's words: its names of async_scheduling, of overlap_outputs and of turning
        that off, and the fix."""
        return AsyncSchedulingError(self.conflict, name=name, overlap=overlap, overlap_off=overlap_off, fix=fix)


def make_block_manager(model: StepModel, num_blocks: int, block_size: int, context: int,
                       enable_prefix_caching: bool, routed_num_blocks: int | None = None) -> BlockManager:
    """The engine's block manager: a BlockManager, or for a model with routed layers a RoutedBlockManager whose
    routed pools are sized by kv_pool.routed_pool_blocks (and logged with the KV memory they save)."""
    routed = num_routed_layers(model)
    if not routed:
        if routed_num_blocks is not None:
            raise KilnError("routed_num_blocks is for Mixture-of-Depths models; this model routes no layer")
        return BlockManager(num_blocks, block_size, enable_prefix_caching)
    nr = routed_pool_blocks(model, num_blocks, context, block_size=block_size, routed_num_blocks=routed_num_blocks)
    bm = RoutedBlockManager(num_blocks, block_size, routed, nr, enable_prefix_caching)
    have, dense = pool_bytes(model, bm)
    log.info("KV cache: %d blocks for %d dense layers, %d per routed layer for %d routed layers: %.1f MiB, %.1f MiB "
             "(%.0f%%) less than caching every token in every layer", num_blocks - 1, model.num_layers, nr - 1, routed,
             have / 2**20, (dense - have) / 2**20, 100 * (1 - have / dense))
    return bm



def pool_bytes(model: StepModel, bm: BlockManager) -> tuple[int, int]:
    """(bytes of the KV pools, bytes they would take if every layer cached every token in the dense pool's blocks)."""
    block = kv_bytes_per_layer_block(model, bm.block_size)
    have = dense = bm.num_blocks * kv_bytes_per_block(model, bm.block_size)
    for g in getattr(bm, "routed", ()):
        have += g.num_blocks * block
        dense += bm.num_blocks * block
    return have, dense


class EngineSetup:
    """An Engine's parts and its two switches (see the module docstring); requests and steps are Engine's."""

    def __init__(
        self,
        step_model: StepModel,
        tokenizer: TokenizerLike | None,
        cfg: ModelLimits,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        use_cuda_graphs: bool | None = None,
        pad_decode_batches: bool = False,
        scheduling_policy: str = "continuous",
        max_model_len: int | None = None,
        drafter: NgramDrafter | ModelDrafter | None = None,
        speculation_max_batch: int | None = None,
        routed_num_blocks: int | None = None,
        overlap_outputs: bool | None = None,
        async_scheduling: bool | None = None,
    ):
        """drafter: speculative decoding (the verifier is step_model.verify). speculation_max_batch: speculate only
        while at most this many decode-ready requests run (None: DEFAULT_SPECULATION_MAX_BATCH, measured).
        routed_num_blocks: blocks in each routed layer's pool of a Mixture-of-Depths model (None: from its routed
        capacity, see runtime/kv_pool.py). overlap_outputs: build each step's outputs during the next step's model
        call (see step(); None: on for a CUDA model, whose calls are asynchronous, off elsewhere, where it could
        only delay the outputs). async_scheduling: schedule and launch the next decode step before this one's
        sampled ids reach the host (see step(); implies overlap_outputs; None: on for a CUDA model with
        overlap_outputs on and no drafter, which it is not built for)."""
        block_size = check_engine_args(step_model, cfg, drafter, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens, num_blocks=num_blocks,
                                       block_size=block_size, max_model_len=max_model_len,
                                       gpu_memory_utilization=gpu_memory_utilization,
                                       speculation_max_batch=speculation_max_batch,
                                       flags=dict(enable_prefix_caching=enable_prefix_caching,
                                                  use_cuda_graphs=use_cuda_graphs, overlap_outputs=overlap_outputs,
                                                  async_scheduling=async_scheduling))
        self.model = step_model
        self.tokenizer = tokenizer
        self.cfg = cfg
        # max_model_len below the model's context shrinks the smallest acceptable pool (one max-length sequence).
        self.max_model_len = cfg.context if max_model_len is None else max_model_len
        # An eos id past the model's vocabulary can never be sampled; kept, min_tokens' mask would index past the
        # logits (a device-side assert on CUDA).
        self.eos_token_ids = tuple(t for t in getattr(tokenizer, "eos_token_ids", ()) or () if t < step_model.vocab)
        self.verify = getattr(step_model, "verify", None) if drafter is not None else None
        extra = drafter.kv_bytes_per_block(block_size) if drafter is not None else 0
        extra += routed_bytes_per_block(step_model, block_size)
        n = choose_num_blocks(step_model, self.max_model_len, block_size=block_size, num_blocks=num_blocks,
                              gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                              extra_bytes_per_block=extra)
        self.block_manager: BlockManager = make_block_manager(
            step_model, n, block_size, self.max_model_len, enable_prefix_caching, routed_num_blocks)
        self.kv_bytes, self.kv_bytes_dense = pool_bytes(step_model, self.block_manager)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, policy=scheduling_policy)
        graphs = step_model.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if graphs and step_model.device.type != "cuda":  # asked for, not silently dropped
            log.warning("use_cuda_graphs=True has no effect on a %s model (CUDA graphs need CUDA); decoding eagerly",
                        step_model.device.type)
        spec_batch = DEFAULT_SPECULATION_MAX_BATCH if speculation_max_batch is None else speculation_max_batch
        # Verification batches get graphs (or padding) up to the batch where speculation turns itself off.
        self.runner = ModelRunner(step_model, self.block_manager, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, use_cuda_graphs=graphs,
                                  pad_decode_batches=pad_decode_batches, spec_k=drafter.k if drafter is not None else 0,
                                  spec_max_batch=spec_batch)
        self.drafter = drafter
        if drafter is not None:
            drafter.bind(step_model, self.block_manager, self.runner.kv_cache, max_num_seqs=max_num_seqs,
                         max_model_len=self.max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                         use_cuda_graphs=graphs, pad_decode_batches=pad_decode_batches, max_batch=spec_batch)
            self.scheduler.spec_k = drafter.k
            self.scheduler.spec_context = drafter.context
            self.scheduler.spec_max_batch = spec_batch
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        overlap = step_model.device.type == "cuda" if overlap_outputs is None else bool(overlap_outputs)
        if async_scheduling and overlap_outputs is False:
            raise AsyncSchedulingError("overlap_outputs")
        if async_scheduling is None:
            async_scheduling = overlap and step_model.device.type == "cuda" and drafter is None
        self.output = OutputMaker(self.scheduler, self.block_manager, self.requests, self.eos_token_ids, overlap)
        self.ahead = AsyncSteps(self.scheduler, self.runner, self.output)  # the step in flight (async scheduling)
        self._async = False
        self.async_scheduling = bool(async_scheduling)  # refused with a drafter; turns the overlap on
        self.spec_counters = SpecCounters()
        self.spec = None if drafter is None else SpecStep(drafter, self.verify, self.output, self.spec_counters)
        self._ids = itertools.count()
        self._seed_note = False  # said once that seeded sampling does not speculate
        self.num_steps = 0
        self.num_batched_tokens = 0

    @property
    def overlap_outputs(self) -> bool:
        """Whether each step's output work runs during the next step's model call (see step())."""
        return self.output.overlap

    @overlap_outputs.setter
    def overlap_outputs(self, on: bool) -> None:
        if not on:
            self.async_scheduling = False  # it makes outputs one call later by construction
        self.output.overlap = bool(on)

    @property
    def async_scheduling(self) -> bool:
        """Whether a decode step is scheduled and launched before the last one's sampled ids are read (step())."""
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if on and self.drafter is not None:
            raise AsyncSchedulingError("speculation")
        if not on:
            self.ahead.land()
        else:
            self.output.overlap = True
        self._async = bool(on)
