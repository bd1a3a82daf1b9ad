"""From a Schedule to a StepBatch, and the call into the step model (eager, or CUDA-graph replay for decodes).

On CUDA, pure-decode steps replay graphs captured for batch sizes 1, 2, 4, 8, ... up to max_num_seqs: the
batch is padded to the next captured size with rows that write to and read from the null block (block 0),
block tables always have the full width (max_model_len / block_size) and max_context_len is max_model_len,
so nothing the kernels see on the host changes between replays. `pad_decode_batches` runs the same padded
batches eagerly: it is how the padding is tested without a GPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kiln.runtime.block_manager import NULL_BLOCK, BlockManager
from kiln.runtime.scheduler import Schedule, ScheduledSeq
from kiln.step import StepBatch, StepModel, allocate_kv_cache


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
    out: torch.Tensor  # the static output [B, vocab]


class ModelRunner:
    def __init__(self, model: StepModel, block_manager: BlockManager, *, max_num_seqs: int, max_model_len: int,
                 use_cuda_graphs: bool = False, pad_decode_batches: bool = False):
        self.model = model
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_cache = allocate_kv_cache(model, block_manager.num_blocks, self.block_size)  # passed through as is
        self.use_cuda_graphs = use_cuda_graphs and model.device.type == "cuda" and torch.cuda.is_available()
        self.pad_sizes = graph_batch_sizes(max_num_seqs) if (self.use_cuda_graphs or pad_decode_batches) else []
        self.graphs: dict[int, _Graph] = {}
        if self.use_cuda_graphs:
            self._capture_all()

    # ---- batch building -----------------------------------------------------------------------------------

    def prepare(self, sched: Schedule) -> tuple[StepBatch, int]:
        """The StepBatch for a schedule, and how many rows (graph padding) it was padded to."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        qsl = [0]
        sample_rows: list[int] = []
        for s in sched.seqs:
            req, end = s.request, s.start + s.num_new
            table = self.bm.table(req.request_id)
            assert len(table) * bs >= end, f"{req.request_id}: {end} tokens but {len(table)} blocks"
            tokens += req.token_slice(s.start, end)
            positions += range(s.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, end)]
            tables.append(table)
            context_lens.append(end)
            qsl.append(qsl[-1] + s.num_new)
            if s.sample:
                sample_rows.append(qsl[-1] - 1)
        padded = self._pad_size(sched)
        width = self.max_blocks_per_seq if padded else max(len(t) for t in tables)
        if padded:
            extra = padded - len(sched.seqs)
            tokens += [0] * extra
            positions += [0] * extra
            slots += [NULL_BLOCK * bs] * extra
            tables += [[]] * extra
            context_lens += [1] * extra
            qsl += range(qsl[-1] + 1, qsl[-1] + 1 + extra)
            sample_rows = list(range(padded))
        block_tables = [t + [NULL_BLOCK] * (width - len(t)) for t in tables]
        dev = self.model.device
        batch = StepBatch(
            tokens=_to(tokens, torch.int64, dev),
            positions=_to(positions, torch.int64, dev),
            slot_mapping=_to(slots, torch.int64, dev),
            block_tables=_to(block_tables, torch.int32, dev),
            context_lens=_to(context_lens, torch.int32, dev),
            query_start_loc=_to(qsl, torch.int32, dev),
            sample_indices=_to(sample_rows, torch.int64, dev),
            max_query_len=1 if padded else max(s.num_new for s in sched.seqs),
            max_context_len=self.max_model_len if padded else max(context_lens),
        )
        return batch, padded

    def _pad_size(self, sched: Schedule) -> int:
        if not self.pad_sizes or not sched.is_decode_only or len(sched.seqs) > self.pad_sizes[-1]:
            return 0
        return next(b for b in self.pad_sizes if b >= len(sched.seqs))

    # ---- execution ----------------------------------------------------------------------------------------

    def execute(self, sched: Schedule) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """fp32 logits [R, vocab], one row per sampled sequence, and those sequences in row order."""
        sampled = [s for s in sched.seqs if s.sample]
        batch, padded = self.prepare(sched)
        with torch.inference_mode():
            if padded and padded in self.graphs:
                logits = self._replay(self.graphs[padded], batch)
            else:
                logits = self.model(batch, self.kv_cache)
        return logits[: len(sampled)].float(), sampled

    # ---- CUDA graphs (only with a CUDA device; not exercised by the CPU test suite) ----------------------

    def _capture_all(self) -> None:
        biggest = self.pad_sizes[-1]
        dev = self.model.device
        self._static = StepBatch(
            tokens=torch.zeros(biggest, dtype=torch.int64, device=dev),
            positions=torch.zeros(biggest, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((biggest,), NULL_BLOCK * self.block_size, dtype=torch.int64, device=dev),
            block_tables=torch.full((biggest, self.max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32, device=dev),
            context_lens=torch.ones(biggest, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(biggest + 1, dtype=torch.int32, device=dev),
            sample_indices=torch.arange(biggest, dtype=torch.int64, device=dev),
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for b in reversed(self.pad_sizes):  # largest first, so later graphs fit in its memory pool
                    self.graphs[b] = self._capture(b, pool)
        except Exception as e:  # a step model that syncs or allocates on the host cannot be captured
            self.graphs.clear()
            print(f"kiln: CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", file=sys.stderr)

    def _capture(self, b: int, pool: object) -> _Graph:
        st = self._static
        batch = StepBatch(st.tokens[:b], st.positions[:b], st.slot_mapping[:b], st.block_tables[:b],
                          st.context_lens[:b], st.query_start_loc[: b + 1], st.sample_indices[:b], 1,
                          self.max_model_len)
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
    def _replay(g: _Graph, batch: StepBatch) -> torch.Tensor:
        for name in ("tokens", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
                     "sample_indices"):
            getattr(g.batch, name).copy_(getattr(batch, name), non_blocking=True)
        g.graph.replay()
        return g.out


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
