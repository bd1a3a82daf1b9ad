"""ModelRunner.prepare's decode fast path (gather_decodes, then numpy over the gathered lists) against its general
path, on random decode batches: requests with prompts and outputs of random lengths, draft-model decodes past the
known tokens (positions in Request.draft_tokens), rows reused after frees and truncations, padded or not, the
schedule flagged plain_decodes or not; and batches that are not all decodes, which the fast path must leave to
the general one."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.runtime.model_runner as runner_mod
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule, ScheduledSeq
from tests.support.fake_step import HostOnlyModel
from tests.support.prepare_snapshot import DENSE, snapshot


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad=st.booleans(), block=st.sampled_from([1, 2, 4, 16]))
def test_the_decode_path_builds_the_general_paths_inputs(seed, pad, block):
    rng = random.Random(seed)
    bm = BlockManager(400, block, enable_prefix_caching=False)
    runner = ModelRunner(HostOnlyModel(), bm, max_num_seqs=8, max_model_len=64, pad_decode_batches=pad)
    runner.decode_numpy_min_seqs = 1  # every batch here is small
    live: dict[str, Request] = {}
    for step in range(12):
        for rid in [r for r in live if rng.random() < 0.2]:  # frees: their rows go back and are reused
            bm.free(rid)
            del live[rid]
        while len(live) < rng.randint(1, 8):
            rid = f"r{step}-{len(live)}"
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
            req = Request(rid, None, prompt, SamplingParams(max_tokens=20), Detokenizer(None))
            req.output_token_ids = [rng.randrange(50) for _ in range(rng.randint(0, 10))]
            live[rid] = req
        seqs = []
        for req in live.values():
            req.output_token_ids.append(rng.randrange(50))  # a token per step, so the rows gain blocks
            req.draft_tokens = [rng.randrange(50) for _ in range(rng.randint(0, 3))]
            start = req.num_tokens - 1 + rng.randint(0, len(req.draft_tokens))  # a draft model's later decodes
            if rng.random() < 0.2 and bm.table(req.request_id):  # rejected drafts: the row is cut and rewritten
                bm.truncate(req.request_id, bm.num_slots(req.request_id) - block)
            assert bm.append_slots(req.request_id, start + 1)
            seqs.append(ScheduledSeq(req, start, 1, True))
        rng.shuffle(seqs)
        mixed = rng.random() < 0.15
        if mixed:  # a chunk of several tokens: not a decode batch
            s = seqs[0]
            s.start, s.num_new = max(s.start - 2, 0), min(s.start, 2) + 1
        sched = Schedule(seqs, plain_decodes=not mixed and rng.random() < 0.5)
        assert snapshot(runner, sched, general=False, names=DENSE) == snapshot(runner, sched, general=True, names=DENSE)


def test_a_decode_batch_takes_the_fast_path_and_a_mixed_one_does_not():
    bm = BlockManager(40, 4, enable_prefix_caching=False)
    runner = ModelRunner(HostOnlyModel(), bm, max_num_seqs=4, max_model_len=64)
    reqs = [Request(str(i), None, [1, 2, 3, i], SamplingParams(max_tokens=4), Detokenizer(None)) for i in range(3)]
    for r in reqs:
        bm.append_slots(r.request_id, 4)
    tables, rows = bm.tables, runner.rows
    decodes = [ScheduledSeq(r, 3, 1, True) for r in reqs]
    got = runner_mod.gather_decodes(decodes, tables, rows, 4)
    assert got is not None and got.starts.tolist() == [3, 3, 3] and got.tokens == [0, 1, 2] and got.width == 1
    mixed = [ScheduledSeq(reqs[0], 0, 4, True), *decodes[1:]]
    assert runner_mod.gather_decodes(mixed, tables, rows, 4) is None
    with pytest.raises(AssertionError, match="5 tokens but 1 blocks"):  # a decode past its table is a bug
        runner_mod.gather_decodes([ScheduledSeq(reqs[0], 4, 1, True)], tables, rows, 4)
