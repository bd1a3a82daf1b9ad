"""The routed half of prefix caching for a Mixture-of-Depths model (RoutedBlockManager's `prefix`).

A routed layer's state after a prefix of whole dense blocks (c_j and the K/V of its routed tokens) is a function of
those tokens alone, so when the dense group hashes a committed block, an entry records, per routed layer, c_j at
that boundary and holds references on the blocks covering those c_j entries (a pseudo-request in each routed
group, so reference counts and invariants stay the BlockManager's). A later request's prefix match stops at the
first block without an entry; on a hit it shares the entry's full routed blocks and gets a fresh block for each
partial tail, copied from the entry's (copy-on-write: take_copies, which the model runner applies before the step;
entries past c_j in the copy are rewritten before any read, because attention reads only up to context_lens).
Entries are evicted least recently used when a routed group runs out of blocks, and a block whose entry is gone is
not shared (the dense cache alone is not enough).

RoutedPrefixCache is a helper object the manager owns, not a mixin: it holds the entries, the boundary lengths a
request's steps passed and the pending tail copies, and works on the routed groups (BlockManagers) it is given.
It never touches the dense group or the manager's per-request routed state; the manager calls it at these points:
- start(request) / forget(request): a request's boundary record begins (its first append or match) / ends (free);
- note_boundaries(...): after a step, c_j at each dense block boundary the step's tokens passed (record);
- add(request, chain, first, cached): after the dense commit hashed chain[first:], an entry per new hash;
- shareable(hash) (the dense match's _shareable), share(request, hash) on a hit: the routed tables and c_j, or None
  when a tail could not be copied (the manager then starts the request from scratch);
- make_room(group, blocks): evict entries until the group has the blocks (append_slots); clear(); take_copies().
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

import numpy as np

from kiln.runtime.block_manager import BlockManager

Lens = tuple[int, ...]  # c_j per routed layer


class RoutedPrefixCache:
    def __init__(self, groups: list[BlockManager], block_size: int):
        self.groups = groups  # one BlockManager per routed layer (the manager's `routed`)
        self.block_size = block_size
        self.entries: OrderedDict[bytes, Lens] = OrderedDict()  # block hash -> c_j there (LRU order)
        self.boundary: dict[str, dict[int, Lens]] = {}  # per request: dense block i -> c_j after its last token
        self.copies: dict[str, list[tuple[int, int, int]]] = {}  # (layer, src, dst) to copy before the step
        self.evictions = 0  # entries dropped to free routed blocks
        self.tail_copies = 0  # partial routed blocks copied for prefix hits

    @staticmethod
    def entry_id(block_hash: bytes) -> str:
        return "\0prefix:" + block_hash.hex()  # a pseudo-request id; NUL-prefixed, unlike the engine's ids

    def start(self, request_id: str) -> None:
        self.boundary.setdefault(request_id, {})

    def forget(self, request_id: str) -> None:
        self.boundary.pop(request_id, None)
        self.copies.pop(request_id, None)

    def note_boundaries(self, request_ids: Sequence[str], starts: np.ndarray, num_new: np.ndarray,
                        offsets: np.ndarray, routed: np.ndarray, old: np.ndarray) -> None:
        """Keep c_j after each dense block boundary in (start, start + m] of a step: request i ran tokens
        [starts[i], starts[i] + num_new[i]), its flags are routed[:, offsets[i]:][:, :num_new[i]], and old[i] is
        its c_j per layer before the step."""
        bs = self.block_size
        for i in np.flatnonzero((starts + num_new) // bs > starts // bs).tolist():
            start, k, o = int(starts[i]), int(num_new[i]), int(offsets[i])
            sums = routed[:, o : o + k].cumsum(axis=1)
            bounds = self.boundary[request_ids[i]]
            for end in range(-(-(start + 1) // bs) * bs, start + k + 1, bs):
                bounds[end // bs - 1] = tuple((old[i] + sums[:, end - start - 1]).tolist())

    def add(self, request_id: str, chain: Sequence[bytes], first: int, cached: Container[bytes]) -> None:
        """An entry for each hash chain[first:] the dense commit just made that the dense cache holds and no entry
        has yet, referencing the request's routed blocks that cover c_j at that boundary."""
        bounds = self.boundary.get(request_id, {})
        for i in range(first, len(chain)):
            lens = bounds.pop(i)
            h = chain[i]
            if h in self.entries or h not in cached:
                continue
            entry = self.entry_id(h)
            for g, c in zip(self.groups, lens, strict=True):
                blocks = g.table(request_id)[: g.blocks_for(c)]
                for b in blocks:
                    g.ref_counts[b] += 1
                g.tables[entry] = list(blocks)
            self.entries[h] = lens

    def shareable(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def share(self, request_id: str, block_hash: bytes) -> Lens | None:
        """A prefix hit ending at the entry block_hash: the request's routed tables get the entry's full blocks and
        a private copy of each partial tail (queued for take_copies). Returns c_j there, or None when a tail found
        no free block; then the request's routed tables are partly set, and the caller frees them."""
        lens = self.entries[block_hash]
        self.entries.move_to_end(block_hash)
        entry = self.entry_id(block_hash)
        copies = []
        for j, (g, c) in enumerate(zip(self.groups, lens, strict=True)):
            full = c // self.block_size
            shared = g.table(entry)[:full]
            for b in shared:
                g.ref_counts[b] += 1
            g.tables[request_id], g._chain[request_id] = list(shared), []
            if c % self.block_size:  # the partial tail: a private copy
                if not self.make_room(g, 1, keep=block_hash) or not g.append_slots(request_id, c):
                    return None
                copies.append((j, g.table(entry)[full], g.table(request_id)[full]))
        self.copies[request_id] = copies
        self.tail_copies += len(copies)
        return lens

    def evict(self, keep: bytes | None = None) -> bool:
        """Drop the least recently used entry (not `keep`) and its block references; False if there is none."""
        victim = next((h for h in self.entries if h != keep), None)
        if victim is None:
            return False
        del self.entries[victim]
        for g in self.groups:
            g.free(self.entry_id(victim))
        self.evictions += 1
        return True

    def make_room(self, g: BlockManager, need: int, keep: bytes | None = None) -> bool:
        """Evict entries until routed group g has `need` free blocks; False if they run out first."""
        while need > g.num_free_blocks:
            if not self.evict(keep):
                return False
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (routed layer, source block, destination block) copies prefix hits need before the next step."""
        out = [c for copies in self.copies.values() for c in copies]
        self.copies.clear()
        return out

    def entry_ids(self) -> set[str]:
        return {self.entry_id(h) for h in self.entries}

    def check(self) -> None:
        for h, lens in self.entries.items():
            for g, c in zip(self.groups, lens, strict=True):
                assert len(g.table(self.entry_id(h))) == g.blocks_for(c), "a prefix entry lost blocks"
