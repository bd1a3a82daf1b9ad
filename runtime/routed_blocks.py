"""Block tables for a Mixture-of-Depths model: the dense pool plus one pool per routed layer, behind one manager.

A routed layer caches only its routed tokens, so a sequence has, besides its dense table, one routed length c_j
and one block table per routed layer j, in that layer's own allocator (a BlockManager over the routed pool's
layer j; block ids are per layer, block 0 of each is its null block). RoutedBlockManager is the dense
BlockManager (the scheduler, engine and runner use it unchanged) that keeps the routed groups in step with it:

- append_slots(request, n): the dense table grows to n tokens, and every routed table to c_j + (n - known), the
  worst case where every token not yet run through the model is routed there; all groups or none (False: the
  scheduler preempts, as for the dense pool);
- record_step(seqs, routed) (record(request, start, routed) for one): after a step, which of the new tokens each
  routed layer routed (the step graph's output) advances c_j, and each routed table is cut back to the blocks
  c_j + 1 entries need (the reservation's other blocks go back at once; a full table keeps the block its next
  token may need, rather than giving it back and taking it again next step); c_j at every dense block boundary
  passed is kept for commit. record_step only takes the flags (on CUDA a copy behind the step): every method that
  reads the routed state first records them (settle), so the host never waits for the step in the model runner;
- free(request): every group's table (preemption by recompute restarts at c_j = 0; chunked prefill carries c_j
  from chunk to chunk because nothing but record changes it).

Prefix caching. A routed layer's state after a prefix of whole dense blocks (c_j and the K/V of its routed
tokens) is a function of those tokens alone, so when the dense group hashes a committed block, an entry records,
per routed layer, c_j at that boundary and holds references on the blocks covering those c_j entries (a
pseudo-request in each routed group, so reference counts and invariants stay the BlockManager's). A later
request's prefix match stops at the first block without an entry; on a hit it shares the entry's full routed
blocks and gets a fresh block for each partial tail, copied from the entry's (copy-on-write: take_copies, which
the model runner applies before the step; entries past c_j in the copy are rewritten before any read, because
attention reads only up to context_lens). Entries are evicted least recently used when a routed group runs out
of blocks, and a block whose entry is gone is not shared (the dense cache alone is not enough).

Per-step cost. c_j and the routed tables are mirrored in numpy by request slot (runtime/routed_state.py), so
record_step is numpy over [sequences, layers] plus Python only for a routed table that gives back a block, and the
runner gathers a step's routed inputs by slot. append_slots keeps, per request, how many tokens every routed table
already has room for (`_limit`): below it only the dense table can grow, as for a dense model; above it (a routed
table is full) the worst case is reserved layer by layer.

Speculative decoding (truncate after rejected drafts) is refused by the engine for routed models, so truncate
here only ever sees the dense group.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.kv_pool import routed_pool_blocks
from kiln.runtime.routed_state import FlagCopy, LensView, RoutedState, step_counts
from kiln.step import StepModel, kv_bytes_per_block, kv_bytes_per_layer_block, num_routed_layers

log = logging.getLogger("kiln.runtime")


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


def _take(g: BlockManager, table: list[int], k: int) -> None:
    """g.append_slots growing a routed table by k blocks, room checked: a routed group never hashes a block (its
    prefix caching is off; RoutedBlockManager keeps entries itself), so there is nothing to evict, and the
    per-call bookkeeping is done (reserved every step where a routed table is full, this is the hot path)."""
    fq, refs = g.free_queue, g.ref_counts
    for _ in range(k):
        block = fq.popitem(last=False)[0]
        refs[block] = 1
        table.append(block)


def _give_back(g: BlockManager, request_id: str, keep: int) -> None:
    """g.truncate(request_id, tokens of `keep` blocks) for a routed table's reserved, private tail blocks."""
    table = g.tables[request_id]
    dropped = table[keep:]
    del table[keep:]
    for listener in g.on_truncate:
        listener(request_id, keep)
    fq, refs = g.free_queue, g.ref_counts
    for block in reversed(dropped):
        assert refs[block] == 1, f"routed block {block} is shared"
        refs[block] = 0
        fq[block] = None
        fq.move_to_end(block, last=False)


def pool_bytes(model: StepModel, bm: BlockManager) -> tuple[int, int]:
    """(bytes of the KV pools, bytes they would take if every layer cached every token in the dense pool's blocks)."""
    block = kv_bytes_per_layer_block(model, bm.block_size)
    have = dense = bm.num_blocks * kv_bytes_per_block(model, bm.block_size)
    for g in getattr(bm, "routed", ()):
        have += g.num_blocks * block
        dense += bm.num_blocks * block
    return have, dense


class RoutedBlockManager(BlockManager):
    reserves_every_token = True  # every routed table grows by the worst case for each token (append_slots)

    def __init__(self, num_blocks: int, block_size: int, num_routed_layers: int, routed_num_blocks: int,
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.routed = [BlockManager(routed_num_blocks, block_size, enable_prefix_caching=False)
                       for _ in range(num_routed_layers)]
        self.state = RoutedState(num_routed_layers)  # c_j and the routed tables by request slot (numpy)
        self.routed_lens = LensView(self.state, self.settle)  # c_j per routed layer: entries written in its cache
        self._known: dict[str, int] = {}  # tokens (from the start) whose routing routed_lens accounts for
        # A step's routing not recorded yet (record_step): (ids, starts, num_new, flags on the host, copy event).
        self._pending: tuple | None = None
        self._flags = FlagCopy()
        # Tokens (from the start) every routed table has room for: append_slots up to it reserves nothing routed.
        self._limit: dict[str, int] = {}
        self._boundary: dict[str, dict[int, tuple[int, ...]]] = {}  # dense block i -> c_j after its last token
        self.entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # block hash -> c_j there (LRU order)
        self._copies: dict[str, list[tuple[int, int, int]]] = {}  # (layer, src, dst) to copy before the step
        self.routed_evictions = 0  # prefix entries dropped to free routed blocks
        self.tail_copies = 0  # partial routed blocks copied for prefix hits

    @property
    def num_routed_layers(self) -> int:
        return len(self.routed)

    @property
    def known(self) -> dict[str, int]:
        """Per request, the tokens (from the start) whose routing routed_lens accounts for."""
        self.settle()
        return self._known

    def routed_state(self) -> RoutedState:
        """The numpy mirror of c_j and the routed tables (what a step's routed inputs are gathered from)."""
        self.settle()
        return self.state

    @staticmethod
    def _entry_id(block_hash: bytes) -> str:
        return "\0prefix:" + block_hash.hex()  # a pseudo-request id; NUL-prefixed, unlike the engine's ids

    # ---- prefix caching -----------------------------------------------------------------------------------

    def _shareable(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        self.settle()
        got = super().match_prefix(request_id, token_ids)
        self._start(request_id)
        if got == 0:
            return 0
        h = self._chain[request_id][-1]
        lens = self.entries[h]
        self.entries.move_to_end(h)
        entry = self._entry_id(h)
        copies = []
        for j, (g, c) in enumerate(zip(self.routed, lens, strict=True)):
            full = c // self.block_size
            shared = g.table(entry)[:full]
            for b in shared:
                g.ref_counts[b] += 1
            g.tables[request_id], g._chain[request_id] = list(shared), []
            if c % self.block_size:  # the partial tail: a private copy
                if not self._make_room(g, 1, keep=h) or not g.append_slots(request_id, c):
                    self._unshare(request_id, got)
                    return 0
                copies.append((j, g.table(entry)[full], g.table(request_id)[full]))
        slot = self.state.slot_of[request_id]
        self.state.lens[slot] = lens
        for j, g in enumerate(self.routed):
            self.state.write(slot, j, g.table(request_id))
        self._known[request_id] = got
        self._limit[request_id] = got + self._room(request_id, lens)
        self._copies[request_id] = copies
        self.tail_copies += len(copies)
        return got

    def _unshare(self, request_id: str, got: int) -> None:
        """A hit whose routed tail could not be copied (no free routed block): start the request from scratch."""
        self.free(request_id)
        self.stats.prefix_hits -= got // self.block_size
        self.tables[request_id], self._chain[request_id] = [], []
        self._start(request_id)

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        self.settle()
        chain = self._chain.get(request_id, [])
        old = len(chain)
        super().commit(request_id, token_ids, num_computed)
        bounds = self._boundary.get(request_id, {})
        for i in range(old, len(chain)):
            lens = bounds.pop(i)
            h = chain[i]
            if h in self.entries or h not in self.cached:
                continue
            entry = self._entry_id(h)
            for g, c in zip(self.routed, lens, strict=True):
                blocks = g.table(request_id)[: g.blocks_for(c)]
                for b in blocks:
                    g.ref_counts[b] += 1
                g.tables[entry] = list(blocks)
            self.entries[h] = lens

    def _evict_entry(self, keep: bytes | None = None) -> bool:
        victim = next((h for h in self.entries if h != keep), None)
        if victim is None:
            return False
        del self.entries[victim]
        for g in self.routed:
            g.free(self._entry_id(victim))
        self.routed_evictions += 1
        return True

    def _make_room(self, g: BlockManager, need: int, keep: bytes | None = None) -> bool:
        while need > g.num_free_blocks:
            if not self._evict_entry(keep):
                return False
        return True

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (routed layer, source block, destination block) copies prefix hits need before the next step."""
        out = [c for copies in self._copies.values() for c in copies]
        self._copies.clear()
        return out

    def reset_prefix_cache(self) -> None:
        self.settle()
        super().reset_prefix_cache()
        while self._evict_entry():
            pass

    # ---- allocation ---------------------------------------------------------------------------------------

    def _start(self, request_id: str) -> None:
        if request_id not in self._known:
            self.state.add(request_id)
            self._known[request_id] = 0
            self._limit[request_id] = 0
            self._boundary[request_id] = {}

    def _room(self, request_id: str, lens: Sequence[int]) -> int:
        """Tokens every routed table of the request can take before one needs a block."""
        bs = self.block_size
        return min((len(g.table(request_id)) * bs - c for g, c in zip(self.routed, lens, strict=True)), default=bs)

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        if self._pending is not None:
            self.settle()
        if num_tokens <= self._limit.get(request_id, -1):  # every routed table has room: only the dense one grows
            table = self.tables.get(request_id)
            if table is not None and num_tokens <= len(table) * self.block_size:
                return True
            return super().append_slots(request_id, num_tokens)
        self._start(request_id)
        st, bs = self.state, self.block_size
        slot = st.slot_of[request_id]
        new = num_tokens - self._known[request_id]
        lens, blocks = st.lens[slot].tolist(), st.blocks[slot].tolist()
        # The worst case (every new token routed) only where a routed table is too short for it; room: the tokens
        # every routed table has room for once grown.
        grow, rooms = [], []
        for j, (c, b) in enumerate(zip(lens, blocks, strict=True)):
            r = b * bs - c
            if r < new:
                k = -(-(c + new) // bs) - b
                grow.append((j, k))
                r += k * bs
            rooms.append(r)
        if self.blocks_for(num_tokens) - len(self.table(request_id)) > self.num_free_blocks:
            return False
        for j, need in grow:
            if not self._make_room(self.routed[j], need):
                return False
        ok = super().append_slots(request_id, num_tokens)
        assert ok, "checked above: the dense pool had room"
        for j, k in grow:
            g = self.routed[j]
            table = g.tables.get(request_id)
            if table is None:  # its first blocks in this group: the group's own bookkeeping starts it
                assert g.append_slots(request_id, lens[j] + new), "checked above: every group had room"
                table = g.tables[request_id]
            else:
                _take(g, table, k)
            st.grow(slot, j, table, blocks[j])
        self._limit[request_id] = self._known[request_id] + min(rooms, default=bs)
        return True

    def record(self, request_id: str, start: int, routed: np.ndarray) -> None:
        """After a step that ran the request's tokens [start, start + m): routed[j, t] is 1 where routed layer j
        routed token start + t (and wrote it). Advances c_j, keeps c_j at each dense block boundary passed, and
        frees the reserved blocks that are not needed (record_step does this for a whole step)."""
        self.settle()
        self._record([request_id], [start], [routed.shape[1]], routed)

    def record_step(self, seqs: Sequence, routed: torch.Tensor | np.ndarray, plain_decodes: bool = False) -> None:
        """record() for a whole step, on the host when the block manager is next used (settle): seqs are the
        step's ScheduledSeqs in row order, routed [layers, rows] its routed flags as the step returned them (rows
        past the sequences' tokens are graph padding, never recorded); plain_decodes: every sequence is one token
        (Schedule.plain_decodes). On CUDA the flags are copied to pinned memory behind the step, so the host does
        not wait for the step here: the engine's work between the model call and reading the sampled ids (the
        previous step's outputs, with overlap_outputs) runs while the device computes, as for a dense model."""
        self.settle()
        ids = [s.request.request_id for s in seqs]
        starts = [s.start for s in seqs]
        num_new = None if plain_decodes else [s.num_new for s in seqs]
        self._pending = (ids, starts, num_new, *self._flags.start(routed))

    def settle(self) -> None:
        """Record the pending step's routing (record_step), waiting for its flags' copy if it is in flight."""
        pending, self._pending = self._pending, None
        if pending is not None:
            ids, starts, num_new, host, event = pending
            self._record(ids, starts, num_new, FlagCopy.wait(host, event))

    def _record(self, request_ids: Sequence[str], starts: Sequence[int], num_new: Sequence[int] | None,
                routed: np.ndarray) -> None:
        known = self._known
        got = list(map(known.__getitem__, request_ids))
        if got != list(starts):
            bad = next(i for i, (k, a) in enumerate(zip(got, starts, strict=True)) if k != a)
            raise AssertionError(f"{request_ids[bad]}: step at {starts[bad]}, routing known to {got[bad]}")
        n = len(request_ids)
        a = np.asarray(starts, dtype=np.int64)
        counts, m, offsets = step_counts(routed, n, num_new)
        st, bs = self.state, self.block_size
        slots = st.slots(request_ids)
        old = st.lens[slots]
        lens = old + counts
        if self.enable_prefix_caching:  # c_j after each dense block boundary in (start, start + m]
            for i in np.flatnonzero((a + m) // bs > a // bs).tolist():
                start, k, o = int(a[i]), int(m[i]), int(offsets[i])
                sums = routed[:, o : o + k].cumsum(axis=1)
                bounds = self._boundary[request_ids[i]]
                for end in range(-(-(start + 1) // bs) * bs, start + k + 1, bs):
                    bounds[end // bs - 1] = tuple((old[i] + sums[:, end - start - 1]).tolist())
        st.lens[slots] = lens
        need = -(-lens // bs)
        have = st.blocks[slots]
        if (need > have).any():
            i, j = (int(x[0]) for x in np.nonzero(need > have))
            raise AssertionError(f"{request_ids[i]}: layer {j} wrote past its table")
        # A reservation's blocks beyond what c_j + 1 entries need go back; the one that gives a full table room
        # for the next token stays (a full table waits ~1 / capacity steps for a routed token, and giving its
        # reserved block back each step only to take it again at the next append_slots was most of the routed
        # host work per decode step). So a table holds at most one block past c_j's, only when c_j fills its
        # blocks exactly.
        keep = np.minimum(have, -(-(lens + 1) // bs))
        over = np.nonzero(have > keep)
        for i, j, k, old_len in zip(*(x.tolist() for x in (*over, keep[over], have[over])), strict=True):
            rid = request_ids[i]
            _give_back(self.routed[j], rid, k)  # the reservation's unneeded blocks
            st.cut(int(slots[i]), j, k, old_len)
        done = (a + m).tolist()
        known.update(zip(request_ids, done, strict=True))
        # Room: to the end of each routed table's last block (a kept spare block included).
        room = (keep * bs - lens).min(axis=1, initial=bs) if n else ()
        self._limit.update(zip(request_ids, (np.asarray(done) + room).tolist(), strict=True))

    def free(self, request_id: str) -> None:
        self.settle()
        super().free(request_id)  # on_free listeners still see the routed lengths
        for g in self.routed:
            g.free(request_id)
        for state in (self._known, self._limit, self._boundary, self._copies):
            state.pop(request_id, None)
        self.state.remove(request_id)

    # ---- accounting ---------------------------------------------------------------------------------------

    def routed_blocks_in_use(self) -> list[int]:
        self.settle()
        return [g.num_usable_blocks - g.num_free_blocks for g in self.routed]

    def check_invariants(self) -> None:
        self.settle()
        super().check_invariants()
        entries = {self._entry_id(h) for h in self.entries}
        for g in self.routed:
            g.check_invariants()
            assert set(g.tables) <= set(self.tables) | entries, "a routed table outlived its request"
            assert not g.cached, "a routed group hashed a block (_take evicts none)"
        assert set(self.routed_lens) == set(self._known) == set(self._limit) <= set(self.tables), \
            "routed state of an unknown request"
        for rid, lens in self.routed_lens.items():
            for g, c in zip(self.routed, lens, strict=True):
                assert g.blocks_for(c) <= len(g.table(rid)), f"{rid}: {c} routed entries in {len(g.table(rid))} blocks"
            self.state.check(rid, lens, [g.table(rid) for g in self.routed])
            assert self._limit[rid] == self._known[rid] + self._room(rid, lens), f"{rid}: stale routed room"
        self.state.check_free()
        for h, lens in self.entries.items():
            for g, c in zip(self.routed, lens, strict=True):
                assert len(g.table(self._entry_id(h))) == g.blocks_for(c), "a prefix entry lost blocks"
