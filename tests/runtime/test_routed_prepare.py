"""A routed (Mixture-of-Depths) model's per-step host work: ModelRunner.prepare's numpy decode path against its
general path (every StepBatch field, the routed lengths and tables included, and both against the block manager's
own lists), and RoutedBlockManager.record_step for a whole step (recorded when the block manager is next used)
against record() one sequence after another (the same lengths, tables, free queues, prefix entries and
reservations), on random schedules."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.routed_state import FlagCopy
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule, ScheduledSeq
from tests.support.prepare_snapshot import ROUTED, snapshot


class HostOnlyRoutedModel:
    """What ModelRunner needs to build a routed model's batches; prepare() never calls it."""

    num_layers, num_kv_heads, head_dim, vocab = 1, 1, 1, 50
    dtype = kv_dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, routed_layers: int):
        self.num_routed_layers = routed_layers
        self.routed_capacity = 0.5


def expected_routed(bm: RoutedBlockManager, seqs: list[ScheduledSeq]) -> tuple[list, list]:
    """The real sequences' routed lengths [layers, S] and tables [layers, S, width] from the block manager's lists."""
    ids = [s.request.request_id for s in seqs]
    width = max(max((len(g.table(r)) for g in bm.routed for r in ids), default=1), 1)
    lens = [[bm.routed_lens[r][j] for r in ids] for j in range(len(bm.routed))]
    tables = [[g.table(r) + [NULL_BLOCK] * (width - len(g.table(r))) for r in ids] for g in bm.routed]
    return lens, tables


def new_request(rng: random.Random, rid: str) -> Request:
    prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
    return Request(rid, None, prompt, SamplingParams(max_tokens=20), Detokenizer(None))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad=st.booleans(), block=st.sampled_from([1, 2, 4, 16]),
       layers=st.integers(1, 3), prefix=st.booleans())
def test_the_routed_decode_path_builds_the_general_paths_inputs(seed, pad, block, layers, prefix):
    rng = random.Random(seed)
    bm = RoutedBlockManager(400, block, layers, 400, enable_prefix_caching=prefix)
    runner = ModelRunner(HostOnlyRoutedModel(layers), bm, max_num_seqs=8, max_model_len=96, pad_decode_batches=pad)
    runner.decode_numpy_min_seqs = 1  # every batch here is small
    live: dict[str, Request] = {}
    fast = made = 0
    for _ in range(10):
        for rid in [r for r in live if rng.random() < 0.2]:  # frees: their slots and rows are reused
            bm.free(rid)
            del live[rid]
        seqs = []
        while len(live) + len(seqs) < rng.randint(1, 8):  # admissions: a prefill chunk, or prefilled at once
            req = new_request(rng, f"r{made}")
            made += 1
            bm.match_prefix(req.request_id, req.prompt_token_ids)
            start, n = bm.known[req.request_id], req.num_tokens
            assert bm.append_slots(req.request_id, n)
            if rng.random() < 0.5:
                seqs.append(ScheduledSeq(req, start, n - start, True))
                continue
            bm.record(req.request_id, start, np.array([[rng.random() < 0.5 for _ in range(n - start)]] * layers))
            live[req.request_id] = req
        for req in live.values():
            req.output_token_ids.append(rng.randrange(50))  # a token per step: the tables gain blocks
            start = req.num_tokens - 1
            assert start == bm.known[req.request_id] and bm.append_slots(req.request_id, start + 1)
            seqs.append(ScheduledSeq(req, start, 1, True))
        rng.shuffle(seqs)
        decodes = all(s.num_new == 1 for s in seqs)
        sched = Schedule(seqs, plain_decodes=decodes and rng.random() < 0.5)
        got = snapshot(runner, sched, general=False, names=ROUTED)
        want = snapshot(runner, sched, general=True, names=ROUTED)
        assert got == want
        lens, tables = expected_routed(bm, seqs)
        s = len(seqs)
        assert [row[:s] for row in got[-2][1]] == lens
        assert [[row[: len(tables[0][0])] for row in t[:s]] for t in got[-1][1]] == tables
        fast += decodes
        flags = np.array([[rng.random() < 0.3 for _ in range(sum(x.num_new for x in seqs) + 3)]] * layers)
        bm.record_step(seqs, flags.astype(np.int32), sched.plain_decodes)  # 3 padding rows, never recorded
        for x in seqs:
            live[x.request.request_id] = x.request
        bm.check_invariants()
    assert fast, "no step was a decode batch"


def state(bm: RoutedBlockManager) -> tuple:
    groups = [(dict(g.tables), list(g.free_queue), list(g.ref_counts)) for g in bm.routed]
    return (dict(bm.routed_lens), dict(bm.known), dict(bm._limit), {r: dict(b) for r, b in bm.prefix.boundary.items()},
            dict(bm.entries), dict(bm.tables), list(bm.free_queue), groups)


@pytest.mark.parametrize("seed", range(6))
def test_record_step_equals_recording_each_sequence_in_turn(seed):
    rng = random.Random(seed)
    twins = [RoutedBlockManager(60, 4, 3, 30), RoutedBlockManager(60, 4, 3, 30)]
    prefix = [rng.randrange(50) for _ in range(9)]
    live: dict[str, list[int]] = {}
    for n in range(120):
        if len(live) < 7:
            rid = f"r{n}"
            live[rid] = (prefix if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 25))]
            assert len({bm.match_prefix(rid, live[rid]) for bm in twins}) == 1
        chunks = []
        for rid, tokens in list(live.items()):
            start = twins[0].known[rid]
            if start == len(tokens):
                tokens.append(rng.randrange(50))  # decode on
            end = min(len(tokens), start + (1 if rng.random() < 0.6 else rng.randint(1, 9)))
            ok = {bm.append_slots(rid, end) for bm in twins}
            assert len(ok) == 1
            if not ok.pop() or rng.random() < 0.03:  # preempted by recompute, or aborted
                for bm in twins:
                    bm.free(rid)
                del live[rid]
                continue
            chunks.append((rid, start, end))
        rng.shuffle(chunks)
        flags = np.array([[rng.random() < 0.4 for _ in range(sum(e - a for _, a, e in chunks))] for _ in range(3)],
                         dtype=np.int32).reshape(3, -1)
        row = 0
        for rid, a, e in chunks:  # one by one
            twins[0].record(rid, a, flags[:, row : row + e - a])
            row += e - a
        seqs = [ScheduledSeq(Request(rid, None, live[rid], SamplingParams(), Detokenizer(None)), a, e - a, True)
                for rid, a, e in chunks]
        if chunks:
            twins[1].record_step(seqs, flags, plain_decodes=all(e - a == 1 for _, a, e in chunks) and seed % 2 == 0)
        for bm in twins:
            for rid, _, e in chunks:
                bm.commit(rid, live[rid], e)
            bm.check_invariants()
        assert state(twins[0]) == state(twins[1])
    assert twins[0].stats.prefix_hits > 0


def test_record_step_refuses_a_step_that_does_not_follow_the_known_routing():
    bm = RoutedBlockManager(20, 4, 2, 20, enable_prefix_caching=False)
    bm.match_prefix("a", [1, 2, 3, 4, 5])
    assert bm.append_slots("a", 5)  # the worst case: 5 routed entries, 2 blocks in each routed layer
    req = Request("a", None, [1, 2, 3, 4, 5], SamplingParams(), Detokenizer(None))
    bm.record_step([ScheduledSeq(req, 1, 4, True)], np.ones((2, 4), dtype=np.int32))
    with pytest.raises(AssertionError, match="a: step at 1, routing known to 0"):
        bm.settle()  # recorded when the block manager is next used
    flags = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.int32)
    bm.record_step([ScheduledSeq(req, 0, 5, True)], flags)
    assert [len(g.table("a")) for g in bm.routed] == [2, 2]  # pending: the reservation is still held
    # Settled: each table keeps the blocks c_j + 1 entries need (room for the next token), the rest goes back.
    assert bm.routed_lens["a"] == [2, 0] and [len(g.table("a")) for g in bm.routed] == [1, 1]
    assert bm._limit["a"] == 7  # layer 0: 2 entries in a block of 4, room for tokens 6 and 7
    assert bm.append_slots("a", 6) and [len(g.table("a")) for g in bm.routed] == [1, 1]
    assert bm.append_slots("a", 8) and [len(g.table("a")) for g in bm.routed] == [2, 1]
    assert bm._limit["a"] == 9  # layer 0: room for 6 more after token 5; layer 1: for 4
    bm.check_invariants()


def test_a_full_routed_table_keeps_its_reserved_block_for_the_next_token():
    bm = RoutedBlockManager(20, 4, 1, 20, enable_prefix_caching=False)
    bm.match_prefix("a", [1, 2, 3, 4])
    assert bm.append_slots("a", 4)
    req = Request("a", None, [1, 2, 3, 4, 5, 6], SamplingParams(), Detokenizer(None))
    bm.record_step([ScheduledSeq(req, 0, 4, True)], np.ones((1, 4), dtype=np.int32))
    assert bm.routed_lens["a"] == [4] and len(bm.routed[0].table("a")) == 1  # full: no room for token 5
    assert bm.append_slots("a", 5) and len(bm.routed[0].table("a")) == 2  # reserved for the worst case
    free = bm.routed[0].num_free_blocks
    for t in (4, 5):  # two decodes its layer does not route: the reserved block stays, nothing is taken again
        bm.record_step([ScheduledSeq(req, t, 1, True)], np.zeros((1, 1), dtype=np.int32))
        assert bm.routed_lens["a"] == [4] and len(bm.routed[0].table("a")) == 2
        assert bm.append_slots("a", t + 2) and bm.routed[0].num_free_blocks == free
    bm.check_invariants()


def test_flag_copy_passes_host_flags_through():
    flags = torch.tensor([[1, 0, 1]], dtype=torch.int32)
    host, event = FlagCopy().start(flags)
    assert host is flags and event is None and FlagCopy.wait(host, event).tolist() == [[1, 0, 1]]
    array = np.array([[0, 1]], dtype=np.int32)
    assert FlagCopy.wait(*FlagCopy().start(array)) is array


@pytest.mark.gpu
def test_flag_copy_brings_device_flags_to_pinned_memory_behind_the_stream():
    copy = FlagCopy()
    for n in (5, 70000, 3):  # the pinned buffer grows, then serves a smaller step
        flags = (torch.arange(2 * n, device="cuda").view(2, n) % 3 == 0).to(torch.int32)
        host, event = copy.start(flags)
        assert host.is_pinned() and event is not None
        assert np.array_equal(FlagCopy.wait(host, event), flags.cpu().numpy())
