"""CUDA graphs of a runner's padded steps: plain decodes and speculative verifications, captured at load.

Two step shapes are captured, each for a list of batch sizes b (1, 2, 4, ... see graph_batch_sizes):

- decode (b, 1): b sequences of one new token each (ModelRunner pads a pure-decode batch to the next size);
- verification (b, q), q = k + 1 for speculation k: b sequences of exactly q new tokens each (a speculative decode
  [last token, d_1..d_n] padded at the front of its chunk, see input_batch.write_verify_batch), every row sampled.
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
from kiln.step import KVCache, StepBatch, StepModel

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
        self.static = self._make_static()

    def _make_static(self) -> StepBatch:
        """Buffers for the most tokens (b * q) and sequences of any shape, on the model's device."""
        dev = self.model.device
        tokens = max(b * q for b, q in self.shapes)
        seqs = max(b for b, _ in self.shapes)
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        routed = {}
        if self.num_routed:  # a routed model's lengths and tables (decode graphs only)
            shape = (self.num_routed, seqs)
            routed = dict(routed_lens=torch.zeros(shape, **i32),
                          routed_block_tables=torch.full((*shape, self.max_blocks_per_seq), NULL_BLOCK, **i32))
        return StepBatch(
            tokens=torch.zeros(tokens, **i64), positions=torch.zeros(tokens, **i64),
            slot_mapping=torch.full((tokens,), NULL_BLOCK * self.block_size, **i64),
            block_tables=torch.full((seqs, self.max_blocks_per_seq), NULL_BLOCK, **i32),
            context_lens=torch.ones(seqs, **i32), query_start_loc=torch.arange(seqs + 1, **i32),
            sample_indices=torch.arange(tokens, **i64), max_query_len=1, max_context_len=self.max_model_len, **routed,
        )  # fmt: skip

    def views(self, b: int, q: int) -> StepBatch:
        """Shape (b, q)'s inputs: views of the first b sequences' and b * q tokens' entries of the static buffers."""
        st, n = self.static, b * q
        routed = {}
        if self.num_routed:  # [:, :b] is strided; mod_kv_slots indexes a layer first, so its rows are contiguous
            routed = dict(routed_lens=st.routed_lens[:, :b], routed_block_tables=st.routed_block_tables[:, :b])
        return StepBatch(st.tokens[:n], st.positions[:n], st.slot_mapping[:n], st.block_tables[:b],
                         st.context_lens[:b], st.query_start_loc[: b + 1], st.sample_indices[:n], q,
                         self.max_model_len, **routed)

    def _reset(self, batch: StepBatch) -> None:
        """Padding values in a shape's views (every sequence on the null block, context 1), for its capture."""
        b, q = batch.num_seqs, batch.max_query_len
        batch.tokens.zero_()
        batch.positions.zero_()
        batch.slot_mapping.fill_(NULL_BLOCK * self.block_size)
        batch.block_tables.fill_(NULL_BLOCK)
        batch.context_lens.fill_(1)
        batch.query_start_loc.copy_(torch.arange(0, b * q + 1, q, dtype=torch.int32))
        batch.sample_indices.copy_(torch.arange(b * q))
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
        except Exception as e:
            self.graphs.clear()
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)

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
        """Copy a padded batch into a graph's static inputs (the same shape)."""
        for name in ("tokens", "positions", "slot_mapping", "context_lens", "query_start_loc", "sample_indices"):
            getattr(static, name).copy_(getattr(batch, name), non_blocking=True)
        # Columns past the batch's widest table keep stale block ids: the kernels never read past a context, and
        # mod_kv_slots never past the block a sequence's routed length needs (reserved, so in the copied columns).
        static.block_tables[:, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        if batch.routed_lens is not None:
            static.routed_lens.copy_(batch.routed_lens, non_blocking=True)
            wr = batch.routed_block_tables.shape[2]
            static.routed_block_tables[:, :, :wr].copy_(batch.routed_block_tables, non_blocking=True)
