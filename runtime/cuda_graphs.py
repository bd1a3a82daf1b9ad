"""CUDA graphs of a runner's padded steps: plain decodes and speculative verifications, captured at load.

Two step shapes are captured, each for a list of batch sizes b (1, 2, 4, ... see graph_batch_sizes):

- decode (b, 1): b sequences of one new token each (ModelRunner pads a pure-decode batch to the next size);
- verification (b, q), q = k + 1 for speculation k: b sequences of exactly q new tokens each (a speculative decode
  [last token, d_1..d_n] padded at the front of its chunk, see decode_batches.write_verify_batch), every row sampled.
  Only up to the batch where speculation turns itself off (Scheduler.spec_max_batch), and never for a routed model
  (speculation is refused there).

All graphs read one set of static input buffers, sized for the most tokens and sequences of any shape; a graph's
inputs are views of their first rows (StepGraphs.views). They were captured with full-width block tables and
max_context_len = max_model_len: a replay copies only the batch's real table columns in (fill), and the kernels
bound their work by the context lengths they read on the device, so a long max_model_len costs nothing per step.
The graphs share one memory pool, captured largest first, so a graph's output (the logits of all its rows, and a
routed model's flags) may share memory with another graph's and is valid only until the next replay of any graph:
everything that reads it (the sampler, the verifier, the routed flags' host copy, the routed counts a step
scheduled ahead adds to its lengths) is queued on the stream before the next replay.

Nothing here runs without a CUDA device except the static buffers, views and fill, which the CPU tests drive to
run padded steps exactly as a replay reads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.input_batch import TENSOR_INPUTS, input_shape
from kiln.step import STEP_INPUTS, KVCache, StepBatch, StepModel

log = logging.getLogger("kiln.runtime")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself (at least 1)."""
    sizes, b, top = [], 1, max(1, max_num_seqs)
    while b < top:
        sizes.append(b)
        b *= 2
    return [*sizes, top]


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    batch: StepBatch  # views of the static input buffers
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # static: logits [b * q, vocab] (and a routed model's flags)


@dataclass
class GraphStats:
    """Padded steps a runner ran, by shape: built as a graph's input shape, and of those, replayed from a graph."""

    padded_decodes: int = 0
    padded_verifications: int = 0
    decode_replays: int = 0
    verification_replays: int = 0


@dataclass
class StepGraphs:
    """The static input buffers and the graphs captured over them, keyed by (batch size, query rows per sequence)."""

    model: StepModel
    kv_cache: KVCache
    block_size: int
    max_blocks_per_seq: int
    max_model_len: int
    num_routed: int
    shapes: list[tuple[int, int]]  # (b, q) to capture
    stats: GraphStats = field(default_factory=GraphStats)
    graphs: dict[tuple[int, int], Graph] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens = max(b * q for b, q in self.shapes)
        # The most tokens (b * q) and sequences of any shape, full-width tables (routed ones: decode graphs only).
        seqs, width = max(b for b, _ in self.shapes), self.max_blocks_per_seq
        self.sizes = {"N": tokens, "R": tokens, "S": seqs, "W": width, "L": self.num_routed, "WR": width}
        self.static = self._make_static()

    def _inputs(self) -> list[str]:
        """The tensor inputs the model takes (the routed ones only for a routed model)."""
        return [name for name in TENSOR_INPUTS if self.num_routed or not STEP_INPUTS[name].routed]

    def _make_static(self) -> StepBatch:
        """Buffers of self.sizes on the model's device, each in its StepInput's dtype and shape, holding padding."""
        dev = self.model.device
        tensors = {name: torch.zeros(input_shape(name, self.sizes), dtype=STEP_INPUTS[name].dtype, device=dev)
                   for name in self._inputs()}  # fmt: skip
        static = StepBatch(**tensors, max_query_len=1, max_context_len=self.max_model_len)
        self._reset(static)
        return static

    def views(self, b: int, q: int) -> StepBatch:
        """Shape (b, q)'s inputs: views of the first b sequences' and b * q tokens' entries of the static buffers
        (the routed ones [:, :b] are strided; mod_kv_slots indexes a layer first, so its rows are contiguous)."""
        st, sizes = self.static, {**self.sizes, "N": b * q, "R": b * q, "S": b}
        tensors = {name: getattr(st, name)[tuple(map(slice, input_shape(name, sizes)))] for name in self._inputs()}
        return StepBatch(**tensors, max_query_len=q, max_context_len=self.max_model_len)

    def _reset(self, batch: StepBatch) -> None:
        """Padding values in a shape's views (every sequence on the null block, context 1, every row sampled), for
        its capture."""
        b, q = batch.num_seqs, batch.max_query_len
        batch.tokens.zero_()
        batch.positions.zero_()
        batch.slot_mapping.fill_(NULL_BLOCK * self.block_size)
        batch.block_tables.fill_(NULL_BLOCK)
        batch.context_lens.fill_(1)
        batch.query_start_loc.copy_(torch.arange(0, b * q + 1, q))  # copy_ casts to the input's dtype
        batch.sample_indices.copy_(torch.arange(batch.sample_indices.shape[0]))
        if batch.routed_lens is not None:
            batch.routed_lens.zero_()
            batch.routed_block_tables.fill_(NULL_BLOCK)

    def capture_all(self) -> None:
        """Capture every shape, most tokens first (later graphs fit in its memory pool); on failure (a step model
        that syncs or allocates on the host cannot be captured) keep none and run eagerly, with one warning."""
        try:
            pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                for b, q in sorted(self.shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True):
                    self.graphs[b, q] = self._capture(b, q, pool)
        except Exception as e:  # the traceback says where the model synced or allocated (logged, not raised)
            self.graphs.clear()
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e, exc_info=True)

    def _capture(self, b: int, q: int, pool: object) -> Graph:
        batch = self.views(b, q)
        self._reset(batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation must not happen under capture
            for _ in range(2):
                self.model(batch, self.kv_cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(batch, self.kv_cache)
        return Graph(graph, batch, out)

    def replay(self, batch: StepBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Run a padded batch from its shape's graph: its output (static tensors, valid until the next replay of
        that graph), or None when no graph has that shape."""
        g = self.graphs.get((batch.num_seqs, batch.max_query_len))
        if g is None:
            return None
        self.fill(g.batch, batch)
        g.graph.replay()
        if batch.max_query_len == 1:
            self.stats.decode_replays += 1
        else:
            self.stats.verification_replays += 1
        return g.out

    @staticmethod
    def fill(static: StepBatch, batch: StepBatch) -> None:
        """Copy a padded batch into a graph's static inputs (the same shape but for the tables' widths)."""
        for name in TENSOR_INPUTS:
            src = getattr(batch, name)
            if src is None:  # a dense model's routed inputs
                continue
            dst = getattr(static, name)
            # Columns past the batch's widest table keep stale block ids: the kernels never read past a context, and
            # mod_kv_slots never past the block a sequence's routed length needs (reserved, so in the copied columns).
            if dst.shape != src.shape:
                dst = dst[tuple(map(slice, src.shape))]
            dst.copy_(src, non_blocking=True)
