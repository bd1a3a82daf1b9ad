"""RoutedBlockManager alone: worst-case reservations given back after the step, all-or-nothing growth, and random
request lives (chunks, aborts, preemptions, shared prefixes) whose routed lengths always equal the routing a
deterministic fake router gives their tokens, with the invariants of every pool holding throughout."""

from __future__ import annotations

import random

import numpy as np

from kiln.runtime.routed_blocks import RoutedBlockManager


def _flags(tokens: list[int], start: int, end: int, layers: int = 2) -> np.ndarray:
    """A fake router: whether token t is routed in layer j depends on the token and its position only (as in the
    causal form, a function of the prefix), so a shared prefix routes the same way."""
    return np.array([[int((tokens[t] * (j + 3) + t) % 3 != 0) for t in range(start, end)] for j in range(layers)])


def test_the_worst_case_is_reserved_then_given_back():
    bm = RoutedBlockManager(9, 4, 2, 9, enable_prefix_caching=False)
    assert bm.match_prefix("a", list(range(10))) == 0
    assert bm.append_slots("a", 10)
    assert [len(bm.table("a")), *(len(g.table("a")) for g in bm.routed)] == [3, 3, 3]
    bm.record("a", 0, np.array([[1, 1, 1] + [0] * 7, [1] * 10]))
    assert bm.routed_lens["a"] == [3, 10] and [len(g.table("a")) for g in bm.routed] == [1, 3]
    assert [g.num_free_blocks for g in bm.routed] == [7, 5]
    assert bm.append_slots("a", 11)  # one more token: layer 0 has room in its block, layer 1 needs a fourth
    assert [len(g.table("a")) for g in bm.routed] == [1, 3]  # 3 + 1 <= 4 and 10 + 1 <= 12
    bm.check_invariants()
    bm.free("a")
    assert all(g.num_free_blocks == 8 for g in (bm, *bm.routed)) and not bm.routed_lens


def test_growth_is_all_or_nothing():
    bm = RoutedBlockManager(20, 4, 2, 5, enable_prefix_caching=False)
    bm.match_prefix("a", [0] * 16)
    assert bm.append_slots("a", 16)  # every routed pool: 4 usable blocks, all taken by the worst case
    bm.match_prefix("b", [0] * 4)
    assert not bm.append_slots("b", 4)
    assert bm.table("b") == [] and all(g.table("b") == [] for g in bm.routed) and bm.num_free_blocks == 15
    # Nothing routed: the reservation goes back but for the block the next token may need.
    bm.record("a", 0, np.zeros((2, 16), dtype=np.int64))
    assert bm.append_slots("b", 4)
    bm.check_invariants()


def test_random_lives_keep_routed_lengths_exact():
    rng = random.Random(0)
    bm = RoutedBlockManager(40, 4, 2, 24)
    prefix = [rng.randrange(50) for _ in range(13)]
    live: dict[str, list[int]] = {}
    copies = 0
    for n in range(300):
        if len(live) < 6:
            rid = f"r{n}"
            tokens = (prefix if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            bm.match_prefix(rid, tokens)
            live[rid] = tokens
        for rid, tokens in list(live.items()):
            start = bm.known[rid]
            if start == len(tokens) or rng.random() < 0.05:  # done, or aborted
                bm.free(rid)
                del live[rid]
                continue
            end = min(len(tokens), start + rng.randint(1, 6))
            if not bm.append_slots(rid, end):  # preempted by recompute: it starts over
                bm.free(rid)
                bm.match_prefix(rid, tokens)
                continue
            copies += len(bm.take_copies())
            bm.record(rid, start, _flags(tokens, start, end))
            bm.commit(rid, tokens, end)
            assert bm.routed_lens[rid] == _flags(tokens, 0, end).sum(1).tolist()
        bm.check_invariants()
    assert bm.stats.prefix_hits > 0 and copies > 0
    for rid in list(live):
        bm.free(rid)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert all(g.num_free_blocks == g.num_usable_blocks and not g.tables for g in (bm, *bm.routed))


def test_a_hit_whose_routed_tail_cannot_be_copied_starts_from_scratch():
    bm = RoutedBlockManager(20, 4, 1, 6)  # 5 usable routed blocks
    a = list(range(9))
    bm.match_prefix("a", a)
    assert bm.append_slots("a", 9)
    bm.record("a", 0, np.array([[1, 1, 1, 0, 1, 1, 0, 0, 1]]))  # c = 3 after block 0, 5 after block 1
    bm.commit("a", a, 9)
    assert sorted(bm.entries.values()) == [(3,), (5,)]
    bm.match_prefix("c", [50] * 12)
    assert bm.append_slots("c", 12) and bm.routed[0].num_free_blocks == 0  # the routed pool is full
    got = bm.match_prefix("b", list(range(8)) + [99, 98])  # both dense blocks cached; layer 0's tail needs a copy
    assert got == 0 and bm.table("b") == [] and bm.routed[0].table("b") == [] and bm.stats.prefix_hits == 0
    assert bm.routed_lens["b"] == [0] and bm.known["b"] == 0 and not bm.take_copies()
    assert bm.routed_evictions == 1 and list(bm.entries.values()) == [(5,)]  # the other entry went, to no avail
    bm.check_invariants()
    for rid in "abc":
        bm.free(rid)
    bm.reset_prefix_cache()
    assert all(g.num_free_blocks == g.num_usable_blocks for g in (bm, *bm.routed))
