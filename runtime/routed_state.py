"""The routed (Mixture-of-Depths) state of every live request as numpy arrays, one slot per request: c_j, each
routed table's length and the routed tables themselves. RoutedBlockManager keeps it in step with its groups' block
lists (which stay the truth for allocation and reference counts), so that a step's routed work is a few numpy
operations over [sequences, layers]: ModelRunner.prepare gathers the step's routed lengths and tables by slot, and
RoutedBlockManager.record_step advances every c_j of the batch at once, with per-sequence Python only where a
routed table changes length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.input_batch import numpy_dtype
from kiln.step import STEP_INPUTS

# lens and tables mirror the step inputs that gather() fills, so they take those inputs' declared dtypes
LENS_DTYPE = numpy_dtype(STEP_INPUTS["routed_lens"].dtype)
TABLES_DTYPE = numpy_dtype(STEP_INPUTS["routed_block_tables"].dtype)


class RoutedState:
    """lens [slots, layers] (c_j), blocks [slots, layers] (each routed table's length), tables [layers, slots,
    width] (each routed table, NULL_BLOCK past its length); slots and width grow by doubling."""

    def __init__(self, num_layers: int, slots: int = 8, width: int = 8):
        self.num_layers = num_layers
        self.slot_of: dict[str, int] = {}
        self.lens = np.zeros((slots, num_layers), dtype=LENS_DTYPE)
        self.blocks = np.zeros((slots, num_layers), dtype=np.int64)  # host bookkeeping only, no step input's
        self.tables = np.full((num_layers, slots, width), NULL_BLOCK, dtype=TABLES_DTYPE)
        self.free_slots = list(range(slots - 1, -1, -1))

    def add(self, request_id: str) -> int:
        """A zeroed slot for a request (c_j = 0, empty tables)."""
        if not self.free_slots:
            old = self.lens.shape[0]
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self.blocks = np.concatenate([self.blocks, np.zeros_like(self.blocks)])
            self.tables = np.concatenate([self.tables, np.full_like(self.tables, NULL_BLOCK)], axis=1)
            self.free_slots.extend(range(2 * old - 1, old - 1, -1))
        slot = self.slot_of[request_id] = self.free_slots.pop()
        return slot

    def remove(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.tables[:, slot, : int(self.blocks[slot].max(initial=0))] = NULL_BLOCK
            self.lens[slot] = 0
            self.blocks[slot] = 0
            self.free_slots.append(slot)

    def write(self, slot: int, layer: int, table: Sequence[int], start: int = 0) -> None:
        """Layer `layer`'s table of the slot's request is now `table`, whose first `start` blocks are already
        written; entries past its length go back to the null block."""
        n, old = len(table), int(self.blocks[slot, layer])
        if n > self.tables.shape[2]:
            wider = np.full((*self.tables.shape[:2], max(n, 2 * self.tables.shape[2])), NULL_BLOCK,
                            dtype=self.tables.dtype)
            wider[:, :, : self.tables.shape[2]] = self.tables
            self.tables = wider
        row = self.tables[layer, slot]
        if n > start:
            row[start:n] = table[start:]
        if old > n:
            row[n:old] = NULL_BLOCK
        self.blocks[slot, layer] = n

    def grow(self, slot: int, layer: int, table: Sequence[int], start: int) -> None:
        """write() for a table that only gained blocks past its first `start` (the reservation's common case)."""
        n = len(table)
        if n > self.tables.shape[2]:
            self.write(slot, layer, table, start)
            return
        self.tables[layer, slot, start:n] = table[start:]
        self.blocks[slot, layer] = n

    def cut(self, slot: int, layer: int, keep: int, old: int) -> None:
        """write() for a table cut from `old` blocks to its first `keep`."""
        self.tables[layer, slot, keep:old] = NULL_BLOCK
        self.blocks[slot, layer] = keep

    def slots(self, request_ids: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self.slot_of.__getitem__, request_ids), dtype=np.intp, count=len(request_ids))

    def width(self, slots: np.ndarray) -> int:
        """The widest routed table of these slots' requests (at least 1)."""
        return max(int(self.blocks[slots].max(initial=0)), 1)

    def check(self, request_id: str, lens: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """The mirror holds the request's c_j and its routed tables (a test of the block manager's upkeep)."""
        slot = self.slot_of[request_id]
        assert self.lens[slot].tolist() == list(lens), f"{request_id}: mirrored routed lengths are stale"
        for j, table in enumerate(tables):
            assert self.blocks[slot, j] == len(table), f"{request_id}: layer {j}'s mirrored table length is stale"
            row = self.tables[j, slot].tolist()
            assert row[: len(table)] == list(table) and set(row[len(table) :]) <= {NULL_BLOCK}, \
                f"{request_id}: layer {j}'s mirrored table is stale"

    def check_free(self) -> None:
        used, free = sorted(self.slot_of.values()), self.free_slots
        assert len(set(used)) == len(used) and not set(used) & set(free), "a slot is shared"
        assert not self.lens[free].any() and not self.blocks[free].any(), "a free slot keeps routed state"
        assert (self.tables[:, free] == NULL_BLOCK).all(), "a free slot keeps a routed table"

    def gather(self, slots: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> None:
        """A step's routed inputs for the requests in `slots`: lens [layers, S] and tables [layers, S, width]."""
        lens[:] = self.lens[slots].T
        tables[:] = self.tables[:, slots, : tables.shape[2]]


def step_counts(routed: np.ndarray, num_seqs: int, num_new: Sequence[int] | None) -> tuple[np.ndarray, ...]:
    """Per sequence of a step whose flat rows are its sequences' tokens in order (one each when num_new is None):
    (routed counts [S, layers], tokens [S], first row [S]) from the flags [layers, rows]."""
    if num_new is None:  # decodes: row i is sequence i's token
        return routed[:, :num_seqs].T.astype(np.int64), np.ones(num_seqs, dtype=np.int64), np.arange(num_seqs)
    m = np.asarray(num_new, dtype=np.int64)
    ends = np.cumsum(m)
    sums = np.zeros((routed.shape[0], int(ends[-1]) + 1 if num_seqs else 1), dtype=np.int64)
    np.cumsum(routed[:, : sums.shape[1] - 1], axis=1, out=sums[:, 1:])
    return (sums[:, ends] - sums[:, ends - m]).T, m, ends - m


class FlagCopy:
    """A step's routed flags on their way to the host: on CUDA a non-blocking copy into pinned memory behind the
    step (the host waits only when it reads them), elsewhere the tensor itself."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def start(self, routed: torch.Tensor | np.ndarray) -> tuple[torch.Tensor | np.ndarray, torch.cuda.Event | None]:
        if not (isinstance(routed, torch.Tensor) and routed.is_cuda):
            return routed, None
        if self.buf is None or self.buf.numel() < routed.numel() or self.buf.dtype != routed.dtype:
            self.buf = torch.empty(max(routed.numel(), 1 << 16), dtype=routed.dtype, pin_memory=True)
        host = self.buf[: routed.numel()].view(routed.shape)
        host.copy_(routed, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(routed.device))
        return host, event

    @staticmethod
    def wait(host: torch.Tensor | np.ndarray, event: torch.cuda.Event | None) -> np.ndarray:
        if event is not None:
            event.synchronize()
        return host.numpy() if isinstance(host, torch.Tensor) else host


class LensView(Mapping):
    """routed_lens[request_id]: c_j per routed layer as a list, read from the state's arrays once `settle` (the
    block manager's: a step's routing may still be pending) has run."""

    def __init__(self, state: RoutedState, settle: Callable[[], None]):
        self.state = state
        self.settle = settle

    def __getitem__(self, request_id: str) -> list[int]:
        self.settle()
        return self.state.lens[self.state.slot_of[request_id]].tolist()

    def __iter__(self) -> Iterator[str]:
        self.settle()
        return iter(self.state.slot_of)

    def __len__(self) -> int:
        self.settle()
        return len(self.state.slot_of)
