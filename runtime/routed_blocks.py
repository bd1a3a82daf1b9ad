"""Block tables for a Mixture-of-Depths model: the dense pool plus one pool per routed layer, behind one manager.

A routed layer caches only its routed tokens, so a sequence has, besides its dense table, one routed length c_j
and one block table per routed layer j, in that layer's own allocator (a BlockManager over the routed pool's
layer j; block ids are per layer, block 0 of each is its null block). RoutedBlockManager is the dense
BlockManager (the scheduler, engine and runner use it unchanged) that keeps the routed groups in step with it:

- append_slots(request, n): the dense table grows to n tokens, and every routed table to c_j + (n - known), the
  worst case where every token not yet run through the model is routed there; all groups or none (False: the
  scheduler preempts, as for the dense pool);
- record(request, num_computed, counts): after a step, the counts the step graph returned advance each c_j, and
  each routed table is cut back to the blocks c_j needs (the reservation's unused blocks go back at once);
- free(request): every group's table (preemption by recompute restarts at c_j = 0; chunked prefill carries c_j
  from chunk to chunk because nothing but record changes it).

Prefix caching is off: a routed layer's state at a dense block boundary (c_j and its blocks, the last one
partial) would have to be recorded per boundary and copied on write; not built, so the dense group runs with
prefix caching off and the engine says so. Speculative decoding (truncate after rejected drafts) is refused by
the engine for routed models, so truncate here only ever sees the dense group.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.block_manager import BlockManager


class RoutedBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, num_routed_layers: int, routed_num_blocks: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.routed = [BlockManager(routed_num_blocks, block_size, enable_prefix_caching=False)
                       for _ in range(num_routed_layers)]
        self.routed_lens: dict[str, list[int]] = {}  # c_j per routed layer: entries written in its cache
        self.known: dict[str, int] = {}  # tokens (from the start) whose routing routed_lens accounts for

    @property
    def num_routed_layers(self) -> int:
        return len(self.routed)

    def routed_len(self, request_id: str, layer: int) -> int:
        return self.routed_lens.get(request_id, [0] * len(self.routed))[layer]

    # ---- allocation ---------------------------------------------------------------------------------------

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        got = super().match_prefix(request_id, token_ids)
        assert got == 0, "prefix caching is off for routed models"
        self._start(request_id)
        return got

    def _start(self, request_id: str) -> None:
        if request_id not in self.routed_lens:
            self.routed_lens[request_id] = [0] * len(self.routed)
            self.known[request_id] = 0

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        self._start(request_id)
        new = num_tokens - self.known[request_id]
        want = [c + new for c in self.routed_lens[request_id]]
        if self.blocks_for(num_tokens) - len(self.table(request_id)) > self.num_free_blocks:
            return False
        for g, n in zip(self.routed, want, strict=True):
            if g.blocks_for(n) - len(g.table(request_id)) > g.num_free_blocks:
                return False
        ok = super().append_slots(request_id, num_tokens)
        for g, n in zip(self.routed, want, strict=True):
            ok = g.append_slots(request_id, n) and ok
        assert ok, "checked above: every group had room"
        return True

    def record(self, request_id: str, num_computed: int, counts: Sequence[int]) -> None:
        """After a step that ran the request up to num_computed tokens: counts[j] of its new tokens were routed
        (and written) in routed layer j. Advances c_j and frees the reserved blocks it did not need."""
        lens = self.routed_lens[request_id]
        for j, (g, n) in enumerate(zip(self.routed, counts, strict=True)):
            lens[j] += int(n)
            assert g.blocks_for(lens[j]) <= len(g.table(request_id)), f"{request_id}: layer {j} wrote past its table"
            g.truncate(request_id, lens[j])
        self.known[request_id] = num_computed

    def free(self, request_id: str) -> None:
        super().free(request_id)  # on_free listeners still see the routed lengths
        for g in self.routed:
            g.free(request_id)
        self.routed_lens.pop(request_id, None)
        self.known.pop(request_id, None)

    # ---- accounting ---------------------------------------------------------------------------------------

    def routed_blocks_in_use(self) -> list[int]:
        return [g.num_usable_blocks - g.num_free_blocks for g in self.routed]

    def check_invariants(self) -> None:
        super().check_invariants()
        for g in self.routed:
            g.check_invariants()
            assert set(g.tables) <= set(self.tables), "a routed table outlived its request"
        assert set(self.routed_lens) == set(self.known) <= set(self.tables), "routed lengths of an unknown request"
        for rid, lens in self.routed_lens.items():
            for g, c in zip(self.routed, lens, strict=True):
                assert g.blocks_for(c) <= len(g.table(rid)), f"{rid}: {c} routed entries in {len(g.table(rid))} blocks"
