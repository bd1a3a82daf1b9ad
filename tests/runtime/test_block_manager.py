"""The paged KV pool: allocation, reference counts, the prefix cache and its LRU, no leaks, pool sizing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError
from kiln.runtime.block_manager import NULL_BLOCK, BlockManager
from kiln.runtime.kv_pool import choose_num_blocks
from tests.support.fake_step import FakeStepModel


def test_append_and_free_never_hand_out_the_null_block():
    bm = BlockManager(6, 4)
    assert bm.num_free_blocks == 5 and bm.num_usable_blocks == 5
    assert bm.append_slots("a", 9)  # 3 blocks
    assert len(bm.table("a")) == 3 and NULL_BLOCK not in bm.table("a")
    assert bm.append_slots("a", 12) and len(bm.table("a")) == 3  # still fits in 3 blocks
    assert not bm.append_slots("b", 12)  # needs 3, 2 free: refused without change
    assert bm.table("b") == [] and bm.num_free_blocks == 2
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 5 and set(bm.ref_counts) == {0}
    bm.check_invariants()


def _admit(bm: BlockManager, rid: str, tokens: list[int]) -> int:
    hit = bm.match_prefix(rid, tokens)
    assert bm.append_slots(rid, len(tokens))
    bm.commit(rid, tokens, len(tokens))
    return hit


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(32, 4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert _admit(bm, "a", prompt) == 0
    assert _admit(bm, "b", prompt + [99]) == 8  # both full blocks reused
    assert bm.table("a")[:2] == bm.table("b")[:2] and bm.table("a")[2] != bm.table("b")[2]
    assert bm.num_shared_blocks() == 2 and bm.stats.prefix_hits == 2
    bm.free("a")
    assert bm.num_shared_blocks() == 0 and bm.ref_counts[bm.table("b")[0]] == 1
    bm.check_invariants()


def test_the_last_token_is_never_served_from_cache():
    bm = BlockManager(32, 4)
    _admit(bm, "a", list(range(8)))
    assert bm.match_prefix("b", list(range(8))) == 4  # 2 full blocks cached, but the model must see token 7
    bm.check_invariants()


def test_different_first_block_breaks_the_chain():
    bm = BlockManager(32, 4)
    _admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first: the chained hash does not match.
    assert bm.match_prefix("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(9, 4)  # 8 usable
    _admit(bm, "old", [1] * 8 + [0])  # 3 blocks, 2 of them cached
    _admit(bm, "new", [2] * 8 + [0])
    bm.free("old")
    bm.free("new")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks() == 4
    assert _admit(bm, "again", [1] * 8 + [5]) == 8  # revived from the free queue
    bm.free("again")
    # 8 blocks needed: every cached block is evicted, unhashed ones first, then least recently used.
    assert bm.match_prefix("big", [7] * 32) == 0 and bm.append_slots("big", 32)
    assert bm.num_cached_blocks() == 0 and bm.stats.evictions == 4
    bm.check_invariants()
    bm.free("big")
    assert bm.num_free_blocks == 8


def test_duplicate_computation_keeps_one_cached_copy():
    bm = BlockManager(16, 4)
    for rid in ("a", "b"):  # admitted in the same step: neither finds the other's blocks
        assert bm.match_prefix(rid, list(range(9))) == 0
        assert bm.append_slots(rid, 9)
    bm.commit("a", list(range(9)), 9)
    bm.commit("b", list(range(9)), 9)
    assert bm.num_cached_blocks() == 2
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(32, 4, enable_prefix_caching=False)
    _admit(bm, "a", list(range(10)))
    assert _admit(bm, "b", list(range(10))) == 0 and bm.num_cached_blocks() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(1, 30)),
                max_size=60))
def test_random_operations_never_leak(ops):
    bm = BlockManager(12, 4)
    lens: dict[str, list[int]] = {}
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in lens:
            toks = [who % 2] * n  # two families of prompts that share prefixes
            done = bm.match_prefix(rid, toks)
            assert done % 4 == 0 and done < n
            if bm.append_slots(rid, n):
                bm.commit(rid, toks, n)
                lens[rid] = toks
            else:
                bm.free(rid)
        elif op == "grow" and rid in lens:
            toks = lens[rid] + [n] * (n % 5)
            if bm.append_slots(rid, len(toks)):
                bm.commit(rid, toks, len(toks))
                lens[rid] = toks
        elif op == "free" and rid in lens:
            bm.free(rid)
            del lens[rid]
        bm.check_invariants()
    for rid in list(lens):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 11 and all(r == 0 for r in bm.ref_counts)


def test_pool_sizing_defaults_and_refuses_a_pool_without_room_for_one_context():
    model = FakeStepModel()
    assert choose_num_blocks(model, 128, block_size=16, num_blocks=50) == 50
    assert choose_num_blocks(model, 128, block_size=16, max_num_seqs=4) == 4 * 8 + 1  # CPU default
    with pytest.raises(KilnError) as err:
        choose_num_blocks(model, 128, block_size=16, num_blocks=8)
    msg = str(err.value)
    assert "8 blocks" in msg and "needs 8 blocks" in msg and "= 9" in msg and "raise num_blocks to at least 9" in msg
    with pytest.raises(KilnError, match="gpu_memory_utilization"):
        choose_num_blocks(model, 128, block_size=16, gpu_memory_utilization=1.5)


def test_truncate_frees_only_the_unused_tail_and_tells_the_listeners():
    bm = BlockManager(10, 4)
    tokens = list(range(9))
    bm.match_prefix("a", tokens)
    assert bm.append_slots("a", 9)
    bm.commit("a", tokens, 8)  # 2 full blocks hashed
    assert bm.append_slots("a", 9 + 5)  # speculative slots: 4 blocks
    seen = []
    bm.on_truncate.append(lambda rid, keep: seen.append((rid, keep)))
    kept = bm.table("a")[:3]
    assert bm.truncate("a", 10) == 1 and bm.table("a") == kept and seen == [("a", 3)]
    assert bm.truncate("a", 10) == 0 and seen == [("a", 3)]  # nothing past it: no call
    bm.check_invariants()
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks() == 2
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 9
