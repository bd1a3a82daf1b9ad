"""What a ModelRunner (runtime/model_runner.py) sets up when it is made, before any step: the KV pool (or a given
cache), the persistent block-table rows and staging buffers, the shapes steps are padded to and their CUDA graphs,
and the warm-up that compiles the kernels; and which of those shapes a step takes (_pad_size, _verify_pad_size).

Two kinds of step are padded to a captured shape and, on CUDA, replayed from graphs (runtime/cuda_graphs.py):

- pure decodes, padded to the next captured batch size (1, 2, 4, 8, ... up to max_num_seqs) with one-token
  sequences that write to and read from the null block (block 0);
- verification batches (speculation k > 0, every sequence a decode chunk of 1 + n tokens, n <= k drafts, at least
  one n > 0): padded to (b, k + 1), every sequence a chunk of exactly k + 1 rows (its real tokens last, padding
  tokens on the null block before them; decode_batches.write_verify_batch says why), then padding sequences, b from
  the captured sizes up to the batch where speculation turns itself off (spec_max_batch); all rows are sampled
  and the real ones come first, so the host reads only those.

The graphs were captured with full-width block tables and max_context_len = max_model_len; a replay copies only
the batch's real columns in, and the kernels bound their work by the context lengths they read on the device, so
a long max_model_len costs nothing per step. `pad_decode_batches` runs the same padded batches eagerly: it is how
the padding is tested without a GPU. graph_stats counts padded steps and replays of each kind.
"""

from __future__ import annotations

import torch

from kiln.errors import KilnError
from kiln.runtime import warmup as kernel_warmup
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.cuda_graphs import Graph, GraphStats, StepGraphs, graph_batch_sizes
from kiln.runtime.input_batch import BlockTableRows, StepBuffers
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.schedule import Schedule
from kiln.step import KVCache, StepModel, allocate_kv_cache, num_routed_layers


class RunnerSetup:
    """ModelRunner's part made at load (see the module docstring); the steps are ModelRunner's."""

    def __init__(self, model: StepModel, block_manager: BlockManager, *, max_num_seqs: int, max_model_len: int,
                 use_cuda_graphs: bool = False, pad_decode_batches: bool = False, warmup: bool | None = None,
                 kv_cache: KVCache | None = None, spec_k: int = 0, spec_max_batch: int | None = None):
        """spec_k: the engine's speculation k (0: none), so verification batches are padded to (b, spec_k + 1) for
        b up to spec_max_batch (None: max_num_seqs) when decodes are; warmup (None: on CUDA) compiles the kernels
        now; kv_cache: an existing cache to run on (a self drafter's view of the target's) instead of a new one."""
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
        padding = self.use_cuda_graphs or pad_decode_batches
        self.pad_sizes = graph_batch_sizes(max_num_seqs) if padding else []
        spec_batch = max_num_seqs if spec_max_batch is None else min(spec_max_batch, max_num_seqs)
        verify = padding and spec_k > 0 and spec_batch > 0 and not self.num_routed
        self.verify_len = spec_k + 1 if verify else 0  # query rows of a padded verification chunk (0: none)
        self.verify_sizes = graph_batch_sizes(spec_batch) if verify else []
        self.graph_stats = GraphStats()
        self.num_routing_ahead = 0  # steps whose routed lengths took the step in flight's counts on the device
        self.cuda_graphs: StepGraphs | None = None
        self.rows = BlockTableRows(self.max_blocks_per_seq, max_num_seqs)
        block_manager.on_free.append(self.rows.release)
        block_manager.on_truncate.append(self.rows.truncate)
        self.buffers = StepBuffers(model.device)
        if model.device.type == "cuda" if warmup is None else warmup:
            self.warmup()
        if self.use_cuda_graphs:
            self.cuda_graphs = self.make_graphs()
            self.cuda_graphs.capture_all()

    def make_graphs(self) -> StepGraphs:
        """The static buffers for every padded shape (on any device; the CPU tests run steps from them), no
        graph captured yet."""
        shapes = [(b, 1) for b in self.pad_sizes] + [(b, self.verify_len) for b in self.verify_sizes]
        return StepGraphs(self.model, self.kv_cache, self.block_size, self.max_blocks_per_seq, self.max_model_len,
                          self.num_routed, shapes, self.graph_stats)

    @property
    def graphs(self) -> dict[int, Graph]:
        """The captured decode graphs by batch size (empty without CUDA graphs, or when the capture failed)."""
        g = self.cuda_graphs
        return {b: graph for (b, q), graph in g.graphs.items() if q == 1} if g is not None else {}

    @property
    def verify_graphs(self) -> dict[int, Graph]:
        """The captured verification graphs (k + 1 rows per sequence) by batch size."""
        g = self.cuda_graphs
        return {b: graph for (b, q), graph in g.graphs.items() if q > 1} if g is not None else {}

    # ---- padded shapes ------------------------------------------------------------------------------------

    def _verify_pad_size(self, sched: Schedule) -> int:
        """The captured batch size a verification batch is padded to: every chunk a decode of 1 + n <= k + 1 rows,
        all sampled, some with drafts (else a pure decode's padding applies); 0 when it is not one or too big."""
        seqs = sched.seqs
        if sched.plain_decodes or len(seqs) > self.verify_sizes[-1]:
            return 0
        drafts = False
        for s in seqs:
            if not s.sample or s.num_new != 1 + s.num_drafts or s.num_new > self.verify_len:
                return 0
            drafts = drafts or s.num_drafts > 0
        return next(b for b in self.verify_sizes if b >= len(seqs)) if drafts else 0

    def _pad_size(self, sched: Schedule) -> int:
        return self._decode_pad_size(len(sched.seqs)) if self.pad_sizes and sched.is_decode_only else 0

    def _decode_pad_size(self, num_seqs: int) -> int:
        """The captured batch size a pure-decode batch of num_seqs is padded to (0: not padded)."""
        if not self.pad_sizes or num_seqs > self.pad_sizes[-1]:
            return 0
        return next(b for b in self.pad_sizes if b >= num_seqs)

    # ---- warm-up: compile the kernels while the model loads, not on the first request (runtime/warmup.py) -----

    def warmup_shapes(self) -> list[tuple[int, int, int]]:
        """(sequences, new tokens each, context) of the warm-up steps (runtime/warmup.py)."""
        return kernel_warmup.warmup_shapes(self.max_model_len, self.verify_len)

    def warmup(self, progress: bool = True) -> None:
        """One step per warm-up shape on dummy batches that touch only the null block (runtime/warmup.py)."""
        kernel_warmup.warmup(self.model, self.kv_cache, self.warmup_shapes(), self.block_size, self.num_routed,
                             progress)
