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

Async scheduling (runtime/async_steps.py): ahead(), pending_step() and free / commit recording only what they need
(pending.settle_for) keep a step in flight's routing pending; runtime/pending_step.py (`pending`) says how.

Prefix caching: the dense group's cache over full blocks, plus an entry per hashed block holding every routed
layer's c_j and blocks at that boundary (shared on a hit, partial tails copied); runtime/routed_prefix.py has the
entries, their eviction and the copies, behind a RoutedPrefixCache the manager owns (`prefix`).

Per-step cost. c_j and the routed tables are mirrored in numpy by request slot (runtime/routed_state.py), so
record_step is numpy over [sequences, layers] plus Python only for a routed table that gives back a block, and the
runner gathers a step's routed inputs by slot. append_slots keeps, per request, how many tokens every routed table
already has room for (`_limit`): below it only the dense table can grow, as for a dense model; above it (a routed
table is full) the worst case is reserved layer by layer.

Speculative decoding (truncate after rejected drafts) is refused by the engine for routed models, so truncate
here only ever sees the dense group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager

import numpy as np
import torch

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.pending_step import PendingRouting, PendingStep
from kiln.runtime.routed_groups import _give_back, _take
from kiln.runtime.routed_prefix import RoutedPrefixCache
from kiln.runtime.routed_state import LensView, RoutedState, step_counts


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
        self.pending = PendingRouting(self._record)  # a step's routing not recorded yet (record_step), ahead()
        # Tokens (from the start) every routed table has room for: append_slots up to it reserves nothing routed.
        self._limit: dict[str, int] = {}
        self.prefix = RoutedPrefixCache(self.routed, block_size)  # routed prefix-cache entries (routed_prefix.py)

    @property
    def num_routed_layers(self) -> int:
        return len(self.routed)

    @property
    def known(self) -> dict[str, int]:
        """Per request, the tokens (from the start) whose routing routed_lens accounts for."""
        self.settle()
        return self._known

    def routed_state(self, settle: bool = True) -> RoutedState:
        """The numpy mirror of c_j and the routed tables (what a step's routed inputs are gathered from); settle
        False: as it is, without the pending step's routing (pending_step), for a step scheduled ahead of it."""
        if settle:
            self.settle()
        return self.state

    def ahead(self) -> AbstractContextManager[None]:
        """Scheduling the step after the one in flight: append_slots reserves without recording that step."""
        return self.pending.ahead()

    def pending_step(self) -> PendingStep | None:
        """The step whose routing is not recorded yet (the one in flight, under async scheduling), or None."""
        return self.pending.step

    # ---- prefix caching (the routed entries: runtime/routed_prefix.py) -------------------------------------

    @property
    def entries(self) -> OrderedDict[bytes, tuple[int, ...]]:
        """Block hash -> c_j per routed layer at that boundary, least recently used first."""
        return self.prefix.entries

    @property
    def routed_evictions(self) -> int:
        return self.prefix.evictions  # prefix entries dropped to free routed blocks

    @property
    def tail_copies(self) -> int:
        return self.prefix.tail_copies  # partial routed blocks copied for prefix hits

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (routed layer, source block, destination block) copies prefix hits need before the next step."""
        return self.prefix.take_copies()

    def _shareable(self, block_hash: bytes) -> bool:
        return self.prefix.shareable(block_hash)

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        self.settle()
        got = super().match_prefix(request_id, token_ids)
        self._start(request_id)
        if got == 0:
            return 0
        lens = self.prefix.share(request_id, self._chain[request_id][-1])
        if lens is None:  # a routed tail found no free block: start the request from scratch
            self.free(request_id)
            self.stats.prefix_hits -= got // self.block_size
            self.tables[request_id], self._chain[request_id] = [], []
            self._start(request_id)
            return 0
        slot = self.state.slot_of[request_id]
        self.state.lens[slot] = lens
        for j, g in enumerate(self.routed):
            self.state.write(slot, j, g.table(request_id))
        self._known[request_id] = got
        self._limit[request_id] = got + self._room(request_id, lens)
        return got

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        self.pending.settle_for(request_id, num_computed)  # the boundaries of the blocks it commits are recorded
        old = len(self._chain.get(request_id, []))
        super().commit(request_id, token_ids, num_computed)
        self.prefix.add(request_id, self._chain.get(request_id, []), old, self.cached)

    def reset_prefix_cache(self) -> None:
        self.settle()
        super().reset_prefix_cache()
        self.prefix.clear()

    # ---- allocation ---------------------------------------------------------------------------------------

    def _start(self, request_id: str) -> None:
        if request_id not in self._known:
            self.state.add(request_id)
            self._known[request_id] = 0
            self._limit[request_id] = 0
            self.prefix.start(request_id)

    def _room(self, request_id: str, lens: Sequence[int]) -> int:
        """Tokens every routed table of the request can take before one needs a block."""
        bs = self.block_size
        return min((len(g.table(request_id)) * bs - c for g, c in zip(self.routed, lens, strict=True)), default=bs)

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        if self.pending.step is not None and not self.pending.scheduling_ahead:
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
            if not self.prefix.make_room(self.routed[j], need):
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
        self.pending.start(seqs, routed, plain_decodes)

    def settle(self) -> None:
        """Record the pending step's routing (record_step), waiting for its flags' copy if it is in flight."""
        self.pending.settle()

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
        if self.enable_prefix_caching:  # c_j after each dense block boundary the step passed
            self.prefix.note_boundaries(request_ids, a, m, offsets, routed, old)
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
        self.pending.settle_for(request_id)
        super().free(request_id)  # on_free listeners still see the routed lengths
        for g in self.routed:
            g.free(request_id)
        for state in (self._known, self._limit):
            state.pop(request_id, None)
        self.prefix.forget(request_id)
        self.state.remove(request_id)

    # ---- accounting ---------------------------------------------------------------------------------------

    def routed_blocks_in_use(self) -> list[int]:
        self.settle()
        return [g.num_usable_blocks - g.num_free_blocks for g in self.routed]

    def check_invariants(self) -> None:
        self.settle()
        super().check_invariants()
        entries = self.prefix.entry_ids()
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
        self.prefix.check()
