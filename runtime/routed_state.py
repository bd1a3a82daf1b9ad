"""The routed (Mixture-of-Depths) state of every live request as numpy arrays, one slot per request: c_j, each
routed table's length and the routed tables themselves. RoutedBlockManager keeps it in step with its groups' block
lists (which stay the truth for allocation and reference counts), so that a step's routed work is a few numpy
operations over [sequences, layers]: ModelRunner.prepare gathers the step's routed lengths and tables by slot, and
RoutedBlockManager.record_step advances every c_j of the batch at once, with per-sequence Python only where a
routed table changes length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from kiln.runtime.block_manager import NULL_BLOCK


class RoutedState:
    """lens [slots, layers] (c_j), blocks [slots, layers] (each routed table's length), tables [layers, slots,
    width] (each routed table, NULL_BLOCK past its length); slots and width grow by doubling."""

    def __init__(self, num_layers: int, slots: int = 8, width: int = 8):
        self.num_layers = num_layers
        self.slot_of: dict[str, int] = {}
        self.lens = np.zeros((slots, num_layers), dtype=np.int64)
        self.blocks = np.zeros((slots, num_layers), dtype=np.int64)
        self.tables = np.full((num_layers, slots, width), NULL_BLOCK, dtype=np.int32)
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
            wider = np.full((*self.tables.shape[:2], max(n, 2 * self.tables.shape[2])), NULL_BLOCK, dtype=np.int32)
            wider[:, :, : self.tables.shape[2]] = self.tables
            self.tables = wider
        row = self.tables[layer, slot]
        if n > start:
            row[start:n] = table[start:]
        if old > n:
            row[n:old] = NULL_BLOCK
        self.blocks[slot, layer] = n

    def slots(self, request_ids: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self.slot_of.__getitem__, request_ids), dtype=np.intp, count=len(request_ids))

    def width(self, slots: np.ndarray) -> int:
        """The widest routed table of these slots' requests (at least 1)."""
        return max(int(self.blocks[slots].max(initial=0)), 1)

    def gather(self, slots: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> None:
        """A step's routed inputs for the requests in `slots`: lens [layers, S] and tables [layers, S, width]."""
        lens[:] = self.lens[slots].T
        tables[:] = self.tables[:, slots, : tables.shape[2]]


class LensView(Mapping):
    """routed_lens[request_id]: c_j per routed layer as a list, read from the state's arrays."""

    def __init__(self, state: RoutedState):
        self.state = state

    def __getitem__(self, request_id: str) -> list[int]:
        return self.state.lens[self.state.slot_of[request_id]].tolist()

    def __iter__(self) -> Iterator[str]:
        return iter(self.state.slot_of)

    def __len__(self) -> int:
        return len(self.state.slot_of)
