"""From a Schedule to a StepBatch, and the call into the step model (eager, or CUDA-graph replay for decodes).

On CUDA, pure-decode steps replay graphs captured for batch sizes 1, 2, 4, 8, ... up to max_num_seqs: the
batch is padded to the next captured size with rows that write to and read from the null block (block 0).
The graphs were captured with full-width block tables and max_context_len = max_model_len; a replay copies
only the batch's real columns in, and the decode kernels bound their work by the context lengths they read
on the device (the split length is per sequence), so a long max_model_len costs nothing per step.
`pad_decode_batches` runs the same padded batches eagerly: it is how the padding is tested without a GPU.

A Mixture-of-Depths model (block manager: runtime.routed_blocks.RoutedBlockManager) also gets, per routed layer, its
routed lengths and block tables (gathered by request slot from the block manager's numpy mirror of them,
runtime/routed_state.py, on the decode fast path too), and its step returns which rows each routed layer routed:
copied to the host behind the step and recorded for the whole batch when the block manager is next used
(RoutedBlockManager.record_step), which gives back the blocks reserved for tokens that were not routed. Its decodes
are padded and replayed from graphs like a dense model's: a padding row is a sequence of routed length 0 whose
routed tables are the null block, so if its router (which sees a dummy token) routes it, kiln::mod_kv_slots sends
its K/V to entry 0 of that routed pool's null block, and the host reads only the real rows' routed flags. The graphs
hold the routed lengths and full-width routed tables in static buffers (a replay copies the batch's real columns, as
for the dense tables); the routing is data, and everything after it (compaction, slots, attention, scatter) is
table-driven on the device, so one capture serves every routing. The routed flags are a graph output, read back
after the replay.

A speculative decode (ScheduledSeq.num_drafts = n) is a chunk of n + 1 tokens with all n + 1 rows sampled; a
step with one is not a pure decode, so it runs eagerly (a GPU would want graphs captured for (batch, k + 1)
query shapes too; not done yet). A draft model's runner shares the block manager and may be given an existing
cache (the target's first layers, as a view) instead of allocating its own.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.runtime.block_manager import NULL_BLOCK, BlockManager
from kiln.runtime.input_batch import BlockTableRows, DecodeInputs, Layout, StepBuffers, gather_decodes, layout
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.scheduler import Schedule, ScheduledSeq
from kiln.step import KVCache, StepBatch, StepModel, allocate_kv_cache, num_routed_layers

log = logging.getLogger("kiln.runtime")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: StepBatch  # views of the static input buffers
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # static: logits [B, vocab] (and a routed model's flags)


class ModelRunner:
    # Decode batches from this many sequences on are staged with numpy (gather_decodes); below it the per-element
    # writes of the general path cost less than numpy's fixed overhead (bench/prepare.py: ~10 us at 1..8).
    decode_numpy_min_seqs = 16

    def __init__(self, model: StepModel, block_manager: BlockManager, *, max_num_seqs: int, max_model_len: int,
                 use_cuda_graphs: bool = False, pad_decode_batches: bool = False, warmup: bool | None = None,
                 kv_cache: KVCache | None = None):
        self.model = model
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_routed = num_routed_layers(model)
        groups = block_manager.routed if isinstance(block_manager, RoutedBlockManager) else []
        if len(groups) != self.num_routed:
            raise KilnError(f"the step model has {self.num_routed} routed (Mixture-of-Depths) layers but the block "
                            f"manager {len(groups)} routed groups; build it with runtime.routed_blocks")
        if kv_cache is None:  # passed through as is
            kv_cache = allocate_kv_cache(model, block_manager.num_blocks, self.block_size,
                                         groups[0].num_blocks if groups else None)
        self.kv_cache = kv_cache
        self.use_cuda_graphs = use_cuda_graphs and model.device.type == "cuda" and torch.cuda.is_available()
        self.pad_sizes = graph_batch_sizes(max_num_seqs) if (self.use_cuda_graphs or pad_decode_batches) else []
        self.graphs: dict[int, _Graph] = {}
        self.rows = BlockTableRows(self.max_blocks_per_seq, max_num_seqs)
        block_manager.on_free.append(self.rows.release)
        block_manager.on_truncate.append(self.rows.truncate)
        self.buffers = StepBuffers(model.device)
        if model.device.type == "cuda" if warmup is None else warmup:
            self.warmup()
        if self.use_cuda_graphs:
            self._capture_all()

    # ---- batch building -----------------------------------------------------------------------------------

    def prepare(self, sched: Schedule) -> tuple[StepBatch, int]:
        """The StepBatch for a schedule, and how many rows (graph padding) it was padded to.

        Costs O(tokens + blocks in the step): tables come from the persistent rows (written when a request
        gains blocks), everything is staged in one buffer and copied to the device once. The batch's tensors
        are views of the runner's buffers, valid until the next prepare().
        """
        bs, seqs = self.block_size, sched.seqs
        if len(seqs) >= self.decode_numpy_min_seqs:
            dec = gather_decodes(seqs, self.bm.tables, self.rows, bs, sched.plain_decodes)
            if dec is not None:
                return self._prepare_decodes(dec)
        tables = [self.bm.table(s.request.request_id) for s in seqs]
        rows = [self.rows.row(s.request.request_id, t) for s, t in zip(seqs, tables, strict=True)]
        width = max(len(t) for t in tables)
        padded = self._pad_size(sched)
        extra = padded - len(seqs) if padded else 0
        n = sum(s.num_new for s in seqs)
        routed_width = 0
        if self.num_routed:  # slots of the block manager's routed state (runtime/routed_state.py)
            routed = self.bm.routed_state()
            routed_slots = routed.slots([s.request.request_id for s in seqs])
            routed_width = routed.width(routed_slots)
        lay = layout(n + extra, padded or sum(s.num_rows for s in seqs), len(seqs) + extra, width, self.num_routed,
                     routed_width)
        v = self.buffers.stage(lay)
        tok, pos, slot, ctx, qsl, samp = (v[k] for k in ("tokens", "positions", "slot_mapping", "context_lens",
                                                         "query_start_loc", "sample_indices"))
        host_rows = self.rows.host
        q = k = max_ctx = max_new = 0
        qsl[0] = 0
        for i, s in enumerate(seqs):
            a, m = s.start, s.num_new
            end = a + m
            assert len(tables[i]) * bs >= end, f"{s.request.request_id}: {end} tokens but {len(tables[i])} blocks"
            if m == 1:  # decode: scalar writes, no temporaries
                tok[q] = s.request.token_slice(a, end)[0]
                pos[q] = a
                slot[q] = tables[i][a // bs] * bs + a % bs
            else:
                p = np.arange(a, end)
                tok[q : q + m] = s.request.token_slice(a, end)
                pos[q : q + m] = p
                slot[q : q + m] = host_rows[rows[i], p // bs].astype(np.int64) * bs + p % bs
            q += m
            ctx[i] = end
            qsl[i + 1] = q
            max_ctx, max_new = max(max_ctx, end), max(max_new, m)
            if s.sample and not padded:
                r = s.num_rows
                samp[k : k + r] = np.arange(q - r, q) if r > 1 else q - 1
                k += r
        bt = v["block_tables"]
        np.take(host_rows[:, :width], rows, axis=0, out=bt[: len(seqs)])
        if self.num_routed:  # padding columns are written by _pad
            routed.gather(routed_slots, v["routed_lens"][:, : len(seqs)], v["routed_block_tables"][:, : len(seqs)])
        if padded:
            self._pad(v, n, len(seqs), padded)
        return self._upload(lay, 1 if padded else max_new, max_ctx), padded

    def _prepare_decodes(self, dec: DecodeInputs) -> tuple[StepBatch, int]:
        """prepare() for plain decodes: the same inputs, written with numpy from the gathered lists."""
        bs, st, rows = self.block_size, dec.starts, dec.rows
        n = len(st)
        padded = self._decode_pad_size(n)
        routed_slots = routed_width = 0
        if self.num_routed:  # the routed lengths and tables by slot of the block manager's routed state
            routed = self.bm.routed_state()
            routed_slots = routed.slots(dec.ids)
            routed_width = routed.width(routed_slots)
        lay = layout(padded or n, padded or n, padded or n, dec.width, self.num_routed, routed_width)
        v = self.buffers.stage(lay)
        host_rows = self.rows.host
        v["tokens"][:n] = dec.tokens
        v["positions"][:n] = st
        v["slot_mapping"][:n] = host_rows[rows, st // bs].astype(np.int64) * bs + st % bs
        v["context_lens"][:n] = st + 1
        v["query_start_loc"][: n + 1] = np.arange(n + 1)
        np.take(host_rows[:, : dec.width], rows, axis=0, out=v["block_tables"][:n])
        if self.num_routed:
            routed.gather(routed_slots, v["routed_lens"][:, :n], v["routed_block_tables"][:, :n])
        if padded:
            self._pad(v, n, n, padded)
        else:
            v["sample_indices"][:] = np.arange(n)
        return self._upload(lay, 1, int(st.max()) + 1), padded

    def _pad(self, v: dict[str, np.ndarray], n: int, num_seqs: int, padded: int) -> None:
        """Padding rows after n tokens of num_seqs decodes: one token each, written to and read from the null
        block, every row sampled. In each routed layer a padding sequence has routed length 0 and the null block
        for a table, so a padding row its router routes writes and reads entry 0 of that pool's null block."""
        v["tokens"][n:], v["positions"][n:], v["slot_mapping"][n:] = 0, 0, NULL_BLOCK * self.block_size
        v["context_lens"][num_seqs:] = 1
        v["query_start_loc"][num_seqs + 1 :] = np.arange(n + 1, n + 1 + padded - num_seqs)
        v["block_tables"][num_seqs:] = NULL_BLOCK
        v["sample_indices"][:] = np.arange(padded)
        if "routed_lens" in v:
            v["routed_lens"][:, num_seqs:] = 0
            v["routed_block_tables"][:, num_seqs:] = NULL_BLOCK

    def _upload(self, lay: Layout, max_query_len: int, max_context_len: int) -> StepBatch:
        t = self.buffers.upload(lay)
        return StepBatch(
            tokens=t["tokens"], positions=t["positions"], slot_mapping=t["slot_mapping"],
            block_tables=t["block_tables"], context_lens=t["context_lens"], query_start_loc=t["query_start_loc"],
            sample_indices=t["sample_indices"], max_query_len=max_query_len, max_context_len=max_context_len,
            routed_lens=t.get("routed_lens"), routed_block_tables=t.get("routed_block_tables"),
        )  # fmt: skip

    def _pad_size(self, sched: Schedule) -> int:
        return self._decode_pad_size(len(sched.seqs)) if self.pad_sizes and sched.is_decode_only else 0

    def _decode_pad_size(self, num_seqs: int) -> int:
        """The captured batch size a pure-decode batch of num_seqs is padded to (0: not padded)."""
        if not self.pad_sizes or num_seqs > self.pad_sizes[-1]:
            return 0
        return next(b for b in self.pad_sizes if b >= num_seqs)

    # ---- execution ----------------------------------------------------------------------------------------

    def execute(self, sched: Schedule) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """fp32 logits [R, vocab] and the sampled sequences in row order: one row per sequence, 1 + n rows for a
        speculative decode with n drafts."""
        sampled = sched.seqs if sched.plain_decodes else [s for s in sched.seqs if s.sample]
        num_rows = len(sampled) if sched.plain_decodes else sum(s.num_rows for s in sampled)
        batch, padded = self.prepare(sched)
        with torch.inference_mode():
            if self.num_routed:  # a one-token prefill after a prefix hit can be a graph's decode batch too
                self._copy_routed_blocks()
            if padded and padded in self.graphs:
                logits = self._replay(self.graphs[padded], batch)
            else:
                logits = self.model(batch, self.kv_cache)
        if self.num_routed:  # [routed layers, N]: real rows in schedule order, then padding (never recorded)
            logits, routed = logits
            self.bm.record_step(sched.seqs, routed, sched.plain_decodes)  # copied behind the step, recorded later
        return logits[:num_rows].float(), sampled

    def _copy_routed_blocks(self) -> None:
        """Copy-on-write of routed blocks that prefix hits share partially filled (RoutedBlockManager.match_prefix),
        before the step writes anything."""
        routed = self.kv_cache.routed
        for layer, src, dst in self.bm.take_copies():
            routed[layer, :, dst].copy_(routed[layer, :, src])

    # ---- warm-up: compile the kernels while the model loads, not on the first request ------------------------

    def warmup_shapes(self) -> list[tuple[int, int, int]]:
        """(sequences, new tokens each, context) of the warm-up steps: prefill and decode, token and sample counts
        of 1, odd and a multiple of 16, short and long contexts (one and several decode splits), so each kernel
        is compiled for the integer specializations a real step hits."""
        long_ctx = min(self.max_model_len, 1024)
        shapes = [(1, 7, 7), (1, 16, 16), (2, 9, 40), (1, 1, 1), (3, 1, long_ctx), (16, 1, 17)]
        return [(s, min(q, min(c, self.max_model_len)), min(c, self.max_model_len)) for s, q, c in shapes]

    def warmup(self, progress: bool = True) -> None:
        """Run one step per warm-up shape on dummy batches that only touch the null block (the blocks padding
        rows use), so Triton compiles (or loads from its disk cache) every kernel variant now."""
        from tqdm import tqdm

        shapes = self.warmup_shapes()
        with torch.inference_mode():
            for shape in tqdm(shapes, desc="kiln: compiling kernels", unit="step", file=sys.stderr,
                              disable=not progress):
                self.model(self._null_batch(*shape), self.kv_cache)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _null_batch(self, num_seqs: int, q_len: int, ctx: int) -> StepBatch:
        dev, bs = self.model.device, self.block_size
        n = num_seqs * q_len
        positions = torch.arange(ctx - q_len, ctx, device=dev).repeat(num_seqs)
        qsl = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
        routed = {}
        if self.num_routed:  # every routed layer starts empty and writes (at most q_len entries) to its null block
            routed = dict(routed_lens=torch.zeros(self.num_routed, num_seqs, dtype=torch.int32, device=dev),
                          routed_block_tables=torch.full((self.num_routed, num_seqs, -(-q_len // bs)), NULL_BLOCK,
                                                         dtype=torch.int32, device=dev))
        return StepBatch(
            tokens=torch.zeros(n, dtype=torch.int64, device=dev), positions=positions,
            slot_mapping=NULL_BLOCK * bs + positions % bs,
            block_tables=torch.full((num_seqs, -(-ctx // bs)), NULL_BLOCK, dtype=torch.int32, device=dev),
            context_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev), query_start_loc=qsl,
            sample_indices=(qsl[1:] - 1).long(), max_query_len=q_len, max_context_len=ctx, **routed,
        )  # fmt: skip

    # ---- CUDA graphs (only with a CUDA device; not exercised by the CPU test suite) ----------------------

    def _capture_all(self) -> None:
        self._static = self._make_static()
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for b in reversed(self.pad_sizes):  # largest first, so later graphs fit in its memory pool
                    self.graphs[b] = self._capture(b, pool)
        except Exception as e:  # a step model that syncs or allocates on the host cannot be captured
            self.graphs.clear()
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)

    def _make_static(self) -> StepBatch:
        """The graphs' input buffers for the biggest batch, holding padding rows (tests build them on CPU too)."""
        biggest = self.pad_sizes[-1]
        dev = self.model.device
        return StepBatch(
            tokens=torch.zeros(biggest, dtype=torch.int64, device=dev),
            positions=torch.zeros(biggest, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((biggest,), NULL_BLOCK * self.block_size, dtype=torch.int64, device=dev),
            block_tables=torch.full((biggest, self.max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32, device=dev),
            context_lens=torch.ones(biggest, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(biggest + 1, dtype=torch.int32, device=dev),
            sample_indices=torch.arange(biggest, dtype=torch.int64, device=dev),
            max_query_len=1,
            max_context_len=self.max_model_len,
            # A routed model's lengths and tables: padding values (length 0, the null block) until a replay.
            **self._static_routed(biggest),
        )

    def _static_routed(self, biggest: int) -> dict[str, torch.Tensor]:
        if not self.num_routed:
            return {}
        dev, shape = self.model.device, (self.num_routed, biggest)
        return dict(routed_lens=torch.zeros(shape, dtype=torch.int32, device=dev),
                    routed_block_tables=torch.full((*shape, self.max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32,
                                                   device=dev))

    def _static_views(self, b: int) -> StepBatch:
        """The graph of batch size b's inputs: views of the first b rows of the static buffers."""
        st = self._static
        routed = {}
        if self.num_routed:  # [:, :b] is strided; mod_kv_slots indexes a layer first, so its rows are contiguous
            routed = dict(routed_lens=st.routed_lens[:, :b], routed_block_tables=st.routed_block_tables[:, :b])
        return StepBatch(st.tokens[:b], st.positions[:b], st.slot_mapping[:b], st.block_tables[:b],
                         st.context_lens[:b], st.query_start_loc[: b + 1], st.sample_indices[:b], 1,
                         self.max_model_len, **routed)

    def _capture(self, b: int, pool: object) -> _Graph:
        batch = self._static_views(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation must not happen under capture
            for _ in range(2):
                self.model(batch, self.kv_cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(batch, self.kv_cache)
        return _Graph(graph, batch, out)

    @staticmethod
    def _replay(g: _Graph, batch: StepBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ModelRunner._fill(g.batch, batch)
        g.graph.replay()
        return g.out

    @staticmethod
    def _fill(static: StepBatch, batch: StepBatch) -> None:
        """Copy a padded decode batch into a graph's static inputs (the same batch size)."""
        for name in ("tokens", "positions", "slot_mapping", "context_lens", "query_start_loc", "sample_indices"):
            getattr(static, name).copy_(getattr(batch, name), non_blocking=True)
        # Columns past the batch's widest table keep stale block ids: the kernels never read past a context, and
        # mod_kv_slots never past the block a sequence's routed length needs (reserved, so in the copied columns).
        static.block_tables[:, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        if batch.routed_lens is not None:
            static.routed_lens.copy_(batch.routed_lens, non_blocking=True)
            wr = batch.routed_block_tables.shape[2]
            static.routed_block_tables[:, :, :wr].copy_(batch.routed_block_tables, non_blocking=True)

