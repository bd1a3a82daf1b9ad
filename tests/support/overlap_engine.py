"""Helpers for the overlap and async-scheduling tests: an engine on the fake model with a byte tokenizer (multi-byte
characters, ids that decode to nothing), a driver that records every step() call's outputs, mixed sampling
parameters, and the churn machine with overlap on."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_machines import EngineMachine
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate

V = 300  # ids 128..255 are parts of multi-byte characters, 256.. decode to nothing: the detokenizer's hard cases


EOS = 7


def make_engine(overlap: bool, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 40)
    return Engine(FakeStepModel(V), ByteTokenizer(V, eos_token_ids=(EOS,)), fake_config(64, vocab=V),
                  overlap_outputs=overlap, **kw)


def view(out) -> tuple:
    c = out.outputs[0]
    return (out.request_id, out.finished, c.token_ids, c.text, c.delta_token_ids, c.delta_text, c.finish_reason,
            c.stop_reason, c.logprobs, c.delta_logprobs, out.error, out.prompt_token_ids)


Script = dict[int, Callable[[Engine], None]]  # call index -> what to do to the engine before that step() call


def drive(eng: Engine, script: Script) -> list[list[tuple]]:
    """Every step() call's outputs, until nothing is left; the script's actions run before their call."""
    calls: list[list[tuple]] = []
    while eng.has_unfinished() or len(calls) in script:
        if len(calls) in script:
            script[len(calls)](eng)
        calls.append([view(o) for o in eng.step()])
        assert len(calls) < 300, "the engine stopped making progress"
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts) and not bm.tables
    return calls


def per_request(calls: list[list[tuple]]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for c in calls:
        for v in c:
            out.setdefault(v[0], []).append(v)
    return out


def both(add: Callable[[Engine], None], script: Script | None = None, **kw) -> tuple[list, list, Engine, Engine]:
    runs = []
    for overlap in (False, True):
        eng = make_engine(overlap, **kw)
        add(eng)
        runs.append((drive(eng, script or {}), eng))
    (off, e_off), (on, e_on) = runs
    assert per_request(on) == per_request(off)
    assert e_on.num_generated_tokens == e_off.num_generated_tokens
    return off, on, e_off, e_on


def prompt(i: int) -> list[int]:
    return [(i * 37 + j * 11) % 250 + 1 for j in range(2 + i % 6)]


def texts_of(params: list[SamplingParams]) -> list[str]:
    """What each request writes without stop strings (to pick stop strings it really meets)."""
    eng = make_engine(False)
    ids = [eng.add_request(prompt_token_ids=prompt(i), params=p) for i, p in enumerate(params)]
    final = {o.request_id: o.outputs[0].text for o in eng.run()}
    return [final[i] for i in ids]


def mixed_params() -> list[SamplingParams]:
    plain = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=1, logprobs=2),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.1, top_p=0.9, max_tokens=15, seed=2),
        SamplingParams(temperature=0, max_tokens=8, logprobs=0, stop=["never-written"]),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=9),
        SamplingParams(temperature=0.7, max_tokens=11, seed=3),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
    ]
    texts = texts_of(plain)
    # Stop strings each request meets mid-way (two of them), and a stop token id one of them samples.
    for i in (2, 3):
        t = texts[i]
        s = next(t[j : j + 2] for j in range(len(t) // 3, len(t) - 1) if "\ufffd" not in t[j : j + 2])
        plain[i] = SamplingParams(**{**vars(plain[i]), "stop": [s, "xyz"]})
    toks = fake_generate(prompt(7), 13, V)
    plain[7] = SamplingParams(**{**vars(plain[7]), "stop_token_ids": (toks[6],)})
    return plain


def add_all(params: list[SamplingParams]) -> Callable[[Engine], None]:
    def add(eng: Engine) -> None:
        for i, p in enumerate(params):
            eng.add_request(prompt_token_ids=prompt(i), params=p, request_id=f"r{i}")
    return add


class OverlapMachine(EngineMachine):
    """The random add / step / abort churn with overlap on: greedy outputs match the oracle, every request
    gets its final output, every block comes back. An abort may meet a request that finished in the last step
    (its final output not made yet): it returns False and that output still comes."""

    def __init__(self):
        super().__init__()
        self.engine.overlap_outputs = True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.engine.abort(rid):
            self.live.discard(rid)
        else:
            assert rid not in self.engine.requests and self.engine.has_unfinished()

    def teardown(self):
        super().teardown()
        assert not self.live, f"{sorted(self.live)} never got a final output"


OverlapMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
