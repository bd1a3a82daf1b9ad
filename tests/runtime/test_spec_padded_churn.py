"""Padded speculative verification (see test_spec_padded.py) under tests/runtime/test_engine_logic.py's property-based
speculative churn: random adds, steps and aborts, preemption, seeded sampling and opt-outs on a small pool, the
greedy oracle of the fake step model and every block back at the end, for the n-gram drafter and fake draft models
with their own pool or sharing the target's cache; which batch sizes get verification graphs; a failed capture;
and prepare()'s padded verification batch against the unpadded one on random schedules (no model needed).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kiln.runtime.block_manager import NULL_BLOCK, BlockManager
from kiln.runtime.cuda_graphs import StepGraphs, graph_batch_sizes
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.runtime.speculative import DEFAULT_SPECULATION_MAX_BATCH, ModelDrafter, NgramDrafter
from kiln.step import KVCache, StepBatch
from tests.support.engine_machines import SpeculativeMachine, V
from tests.support.fake_step import FakeDraftModel, FakeStepModel, HostOnlyModel, fake_config, fake_generate
from tests.support.speculative import reference_verify


class SkipsPadding:
    """A fake step model (tests/support/fake_step.py) that checks and answers only the real rows: a padding row
    (its slot in the null block) gets zero logits, since the fake's context check does not hold for it."""

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        samp = batch.sample_indices
        real = batch.slot_mapping[samp] // kv_cache.block_size != NULL_BLOCK
        out = torch.zeros(samp.shape[0], self.vocab)
        out[real] = super().__call__(dataclasses.replace(batch, sample_indices=samp[real]), kv_cache)
        return out


class PaddedFakeModel(SkipsPadding, FakeStepModel):
    pass


class PaddedFakeDraft(SkipsPadding, FakeDraftModel):
    pass


def padded_churn(kind: str) -> type[SpeculativeMachine]:
    """tests/runtime/test_engine_logic.py's speculative churn (adds, steps, aborts, preemption, seeded sampling and
    opt-outs on a small pool; the greedy oracle; every block back) on a padded engine."""

    class Machine(SpeculativeMachine):
        padded = 0

        def __init__(self):
            RuleBasedStateMachine.__init__(self)
            model = PaddedFakeModel(V)
            model.verify = reference_verify
            drafter = NgramDrafter(n=2, k=3) if kind == "ngram" else ModelDrafter(
                PaddedFakeDraft(V), k=3, shares_target_cache=kind == "shared")
            self.engine = Engine(model, None, fake_config(64), block_size=4, num_blocks=18, max_num_seqs=6,
                                 max_num_batched_tokens=24, drafter=drafter, speculation_max_batch=6,
                                 pad_decode_batches=True)
            self.expect, self.live = {}, set()

        def teardown(self):
            super().teardown()
            type(self).padded += self.engine.runner.graph_stats.padded_verifications

    return Machine


@pytest.mark.parametrize("kind", ["ngram", "own", "shared"])
def test_no_leak_with_padded_speculation_under_churn(kind):
    machine = padded_churn(kind)
    run_state_machine_as_test(machine, settings=settings(max_examples=15, stateful_step_count=30, deadline=None))
    assert machine.padded > 0


def test_verification_graph_sizes_stop_where_speculation_turns_off():
    def make(**kw) -> Engine:
        model = FakeStepModel(V)
        model.verify = reference_verify
        return Engine(model, None, fake_config(64), block_size=4, num_blocks=40, max_num_seqs=kw.pop("max_num_seqs", 6),
                      **kw)

    eng = make(drafter=NgramDrafter(k=3), pad_decode_batches=True, max_num_seqs=64)
    assert eng.runner.pad_sizes == graph_batch_sizes(64) and eng.runner.verify_len == 4
    assert eng.runner.verify_sizes == graph_batch_sizes(DEFAULT_SPECULATION_MAX_BATCH)
    eng = make(drafter=ModelDrafter(FakeDraftModel(V), k=3), pad_decode_batches=True, speculation_max_batch=5)
    assert eng.runner.verify_sizes == [1, 2, 4, 5] and eng.drafter.runner.pad_sizes == [1, 2, 4, 5]
    eng = make(drafter=NgramDrafter(k=3), pad_decode_batches=True, speculation_max_batch=0)
    assert eng.runner.verify_len == 0 and eng.runner.verify_sizes == []
    eng = make(drafter=NgramDrafter(k=3))  # no padding asked (CPU): nothing padded
    assert eng.runner.verify_len == 0 and eng.runner.pad_sizes == []


def test_a_failed_capture_leaves_the_engine_eager_with_one_warning(caplog, monkeypatch):
    """StepGraphs.capture_all when a capture raises (a step model that syncs with the host under capture, or no CUDA
    at all): no graph, one warning, and the padded steps then run eagerly (and are still counted as padded)."""

    def capture(self, b, q, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    model = PaddedFakeModel(V)
    model.verify = reference_verify
    eng = Engine(model, None, fake_config(64), block_size=4, num_blocks=40, max_num_seqs=4, drafter=NgramDrafter(k=3),
                 pad_decode_batches=True)
    graphs = eng.runner.make_graphs()
    assert sorted(graphs.shapes) == [(1, 1), (1, 4), (2, 1), (2, 4), (4, 1), (4, 4)]
    with caplog.at_level("WARNING", logger="kiln.runtime"):
        graphs.capture_all()
    assert graphs.graphs == {} and len(caplog.records) == 1 and "CUDA graph capture failed" in caplog.text
    eng.runner.cuda_graphs = graphs
    prompt = [1, 2, 3] * 3
    ids = [eng.add_request(prompt_token_ids=prompt, params={"max_tokens": 9, "temperature": 0}) for _ in range(3)]
    done = {o.request_id: o.outputs[0].token_ids for o in eng.run()}
    assert [done[i] for i in ids] == [fake_generate(prompt, 9, V)] * 3
    st = eng.runner.graph_stats
    assert st.padded_verifications > 0 and st.verification_replays == st.decode_replays == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block=st.sampled_from([1, 2, 4, 16]))
def test_a_padded_verification_batch_holds_the_unpadded_rows(seed, block):
    """Each real chunk's tokens, positions and slots end its k + 1 rows, contexts and table rows as unpadded; every
    padding token's slot is in the null block; the real rows' sample indices come first, in the unpadded order."""
    rng = random.Random(seed)
    k = rng.randint(1, 5)
    bm = BlockManager(400, block, enable_prefix_caching=False)
    padded = ModelRunner(HostOnlyModel(), bm, max_num_seqs=8, max_model_len=64, pad_decode_batches=True, spec_k=k)
    plain = ModelRunner(HostOnlyModel(), bm, max_num_seqs=8, max_model_len=64)
    seqs = []
    for i in range(rng.randint(1, 8)):
        req = Request(f"r{i}", None, [rng.randrange(50) for _ in range(rng.randint(1, 40))], SamplingParams(),
                      Detokenizer(None))
        n = rng.randint(int(i == 0), k)  # the first one drafts: a verification batch
        req.draft_tokens = [rng.randrange(50) for _ in range(n)]
        start = req.num_tokens - 1
        assert bm.append_slots(req.request_id, start + 1 + n)
        seqs.append(ScheduledSeq(req, start, 1 + n, True, n))
    sched = Schedule(seqs)
    batch, _ = plain.prepare(sched)
    want = {f: getattr(batch, f).tolist() for f in ("tokens", "positions", "slot_mapping", "context_lens",
                                                    "query_start_loc", "block_tables", "sample_indices")}
    got, b = padded.prepare(sched)
    q = k + 1
    assert b == min(x for x in padded.verify_sizes if x >= len(seqs)) and got.max_query_len == q
    assert got.query_start_loc.tolist() == list(range(0, b * q + 1, q))
    rows = []
    for i, s in enumerate(seqs):
        lo, hi = want["query_start_loc"][i : i + 2]
        mine = list(range((i + 1) * q - s.num_new, (i + 1) * q))
        for f in ("tokens", "positions", "slot_mapping"):
            assert [getattr(got, f).tolist()[r] for r in mine] == want[f][lo:hi]
        rows += mine
    slots = got.slot_mapping.tolist()
    assert all(slots[r] // block == NULL_BLOCK for r in set(range(b * q)) - set(rows))
    assert got.sample_indices.tolist()[: len(rows)] == rows and want["sample_indices"] == list(range(len(rows)))
    ctx, tables, n = got.context_lens.tolist(), got.block_tables.tolist(), len(seqs)
    assert ctx[:n] == want["context_lens"] and ctx[n:] == [1] * (b - n)
    width = len(want["block_tables"][0])
    assert [t[:width] for t in tables[:n]] == want["block_tables"] and all(set(t) == {NULL_BLOCK} for t in tables[n:])
