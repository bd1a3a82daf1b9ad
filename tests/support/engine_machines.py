"""Hypothesis state machines that churn an engine on the fake step model (random adds, steps, aborts, with and
without speculative decoding) and check that greedy outputs match the oracle and every block comes back."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import ModelDrafter, NgramDrafter
from tests.support.fake_step import FakeDraftModel, FakeStepModel, fake_config, fake_generate

V = 97


def engine(**kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(FakeStepModel(kw.pop("vocab", V)), kw.pop("tokenizer", None), fake_config(kw.pop("context", 64)),
                  **kw)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


class EngineMachine(RuleBasedStateMachine):
    """Random adds, steps and aborts on a small pool (so preemption happens); every block comes back."""

    def __init__(self):
        super().__init__()
        self.engine = engine(num_blocks=18, max_num_seqs=6, max_num_batched_tokens=24)  # 17 usable, 16 per context
        self.expect: dict[str, list[int]] = {}
        self.live: set[str] = set()

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40), n=st.integers(1, 20))
    def add(self, prompt, n):
        n = min(n, 64 - len(prompt))
        rid = self.engine.add_request(prompt_token_ids=prompt, params=greedy(n))
        self.expect[rid] = fake_generate(prompt, n, V)
        self.live.add(rid)

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            for out in self.engine.step():
                if out.finished:
                    self.live.discard(out.request_id)
                    if out.outputs[0].finish_reason != "abort" and out.request_id in self.expect:  # greedy ones
                        assert out.outputs[0].token_ids == self.expect[out.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort(rid)
        self.live.discard(rid)

    @invariant()
    def blocks_are_accounted(self):
        self.engine.block_manager.check_invariants()
        assert all(0 <= w < 4 for w in self.engine.kv_waste())

    def teardown(self):
        self.step(1)
        while self.engine.has_unfinished():
            self.step(1)
        bm = self.engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts) and not bm.tables


EngineMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


class SpeculativeMachine(EngineMachine):
    """The same churn with speculative decoding (some requests opted out, some sampled with seeds): the
    n-gram drafter, a draft model with its own pool, or one sharing the target's cache. Greedy outputs still
    match the oracle, and every draft slot's block comes back (check_invariants, empty pool at the end)."""

    kind = "ngram"

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.engine = speculative_engine(self.kind)
        self.expect, self.live = {}, set()

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40), n=st.integers(1, 20), opt_out=st.booleans(),
          seed=st.integers(0, 9))  # always seeded: hypothesis replays need a deterministic engine
    def add_sampled(self, prompt, n, opt_out, seed):
        n = min(n, 64 - len(prompt))
        params = SamplingParams(temperature=0.7, top_k=5, max_tokens=n, seed=seed, speculate=not opt_out)
        self.live.add(self.engine.add_request(prompt_token_ids=prompt, params=params))

    def teardown(self):
        super().teardown()
        st = self.engine.stats
        assert st.spec_drafter_failures == 0  # the fake draft model checks every cache slot it reads
        assert st.spec_emitted <= st.spec_rows + st.spec_accepted  # a stop drops the rest of an accepted run


def speculative_engine(kind: str) -> Engine:
    from tests.support.speculative import reference_verify  # kiln.build is heavy: only these tests need it

    model = FakeStepModel(V)
    model.verify = reference_verify
    drafter = NgramDrafter(n=2, k=3) if kind == "ngram" else ModelDrafter(FakeDraftModel(V), k=3,
                                                                         shares_target_cache=kind == "shared")
    return Engine(model, None, fake_config(64), block_size=4, num_blocks=18, max_num_seqs=6, max_num_batched_tokens=24,
                  drafter=drafter, speculation_max_batch=6)


class SpeculativeOwnPoolMachine(SpeculativeMachine):
    kind = "own"


class SpeculativeSharedMachine(SpeculativeMachine):
    kind = "shared"


for _m in (SpeculativeMachine, SpeculativeOwnPoolMachine, SpeculativeSharedMachine):
    _m.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
