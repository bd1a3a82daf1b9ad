"""SamplingParams.output_kind: "delta" outputs carry, call for call, what "cumulative" outputs carry as new;
"final_only" makes one output per request, in the call where the cumulative run makes its last, equal to it. On
every engine path (plain steps, overlap, async scheduling, speculation, chunked prefill with preemption, aborts)
and for requests that fail. Runs on the fake step model (tests/support/fake_step.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kiln.errors import RequestError
from kiln.runtime.batch_sampler import NONFINITE_LOGITS
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import OUTPUT_KINDS, SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_machines import speculative_engine
from tests.support.fake_step import fake_config, fake_generate
from tests.support.faulty_parts import BoomDetokenizer, NaNStepModel
from tests.support.overlap_engine import EOS, Script, V, add_all, drive, make_engine, mixed_params

# view() fields: 0 id, 1 finished, 2 token_ids, 3 text, 4 delta_token_ids, 5 delta_text, 6 finish_reason,
# 7 stop_reason, 8 logprobs, 9 delta_logprobs, 10 error, 11 prompt_token_ids
WHOLE, DELTA, REST = (2, 3, 8), (4, 5, 9), (0, 1, 6, 7, 10, 11)


def pick(view: tuple, idx: tuple[int, ...]) -> tuple:
    return tuple(view[i] for i in idx)


def with_kind(params: list[SamplingParams], kind: str) -> list[SamplingParams]:
    return [dataclasses.replace(p, output_kind=kind) for p in params]


def check_kinds(runs: dict[str, list[list[tuple]]]) -> None:
    """The delta and final_only runs against the cumulative run of the same requests (same engine, same script)."""
    cum = runs["cumulative"]
    assert any(len(call) for call in cum) and any(v[1] for call in cum for v in call)
    # delta: the same outputs in the same calls; the whole fields are the delta fields.
    delta = runs["delta"]
    assert len(delta) == len(cum)
    for got, want in zip(delta, cum, strict=True):
        assert [pick(v, REST + DELTA) for v in got] == [pick(v, REST + DELTA) for v in want]
        assert all(pick(v, WHOLE) == pick(v, DELTA) for v in got)
    # final_only: only the last output of each request, in its call, whole, and all of it new.
    final = runs["final_only"]
    assert len(final) == len(cum)
    for got, want in zip(final, cum, strict=True):
        assert [pick(v, REST + WHOLE) for v in got] == [pick(v, REST + WHOLE) for v in want if v[1]]
        assert all(pick(v, DELTA) == pick(v, WHOLE) for v in got)
    # What a delta stream adds up to is the final output.
    for call in cum:
        for v in call:
            if v[1]:
                parts = [d for c in delta for d in c if d[0] == v[0]]
                assert [t for d in parts for t in d[4]] == v[2] and "".join(d[5] for d in parts) == v[3]


def run_kinds(make: Callable[[], Engine], params: list[SamplingParams],
              script: Script | None = None) -> dict[str, list[list[tuple]]]:
    runs = {}
    for kind in OUTPUT_KINDS:
        eng = make()
        add_all(with_kind(params, kind))(eng)
        runs[kind] = drive(eng, script or {})
    return runs


@pytest.mark.parametrize("mode", ["plain", "overlap", "async"])
def test_every_kind_carries_the_same_outputs(mode):
    def make() -> Engine:
        return make_engine(mode != "plain", async_scheduling=mode == "async")

    check_kinds(run_kinds(make, mixed_params()))


def test_kinds_under_chunked_prefill_preemption_and_aborts():
    engines = []

    def make() -> Engine:  # a small pool and budget: prompts are chunked and requests preempted
        engines.append(make_engine(True, num_blocks=18, max_num_seqs=6, max_num_batched_tokens=10))
        return engines[-1]

    def abort(rid: str, notify: bool = True) -> Callable[[Engine], None]:
        return lambda eng: eng.abort(rid, notify=notify) and None

    script = {3: abort("r1"), 6: abort("r6"), 8: abort("r12", notify=False), 9: abort("r4")}
    runs = run_kinds(make, mixed_params() * 2, script)
    check_kinds(runs)
    assert all(e.scheduler.num_preemptions == engines[0].scheduler.num_preemptions > 0 for e in engines)
    aborted = [v for call in runs["final_only"] for v in call if v[6] == "abort"]
    assert len(aborted) == 3 and all(v[2] and v[3] for v in aborted)  # caught up: tokens and their text


def test_kinds_with_speculative_decoding():
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=12 + i) for i in range(8)]
    runs = {}
    for kind in OUTPUT_KINDS:
        eng = speculative_engine("own")
        eng.tokenizer = ByteTokenizer(97)
        for i, p in enumerate(with_kind(params, kind)):
            eng.add_request(prompt_token_ids=[(i + j) % 5 for j in range(3 + i)], params=p, request_id=f"s{i}")
            eng.requests[f"s{i}"].detokenizer = Detokenizer(eng.tokenizer)  # the tokenizer set after the engine
        runs[kind] = drive(eng, {})
        assert eng.stats.spec_accepted > 0
    check_kinds(runs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_final_only_request_that_fails_keeps_the_tokens_made_before_its_last_step(overlap):
    """Nothing was sent, so nothing is rolled back but the step where the failure showed: a failing detokenizer
    (found when the text is made, at the end) and non-finite logits mid-way."""
    p = [3, 4, 5]
    toks = fake_generate(p, 10, V)
    i = next(i for i in range(2, 10) if toks[i] not in p and toks[i] not in toks[:i])
    poison = toks[i]
    got = {}
    for kind in ("cumulative", "final_only"):
        eng = Engine(NaNStepModel(poison, V), ByteTokenizer(V, eos_token_ids=(EOS,)), fake_config(64, vocab=V),
                     block_size=4, num_blocks=40, overlap_outputs=overlap)
        nan = eng.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=10,
                                                                        ignore_eos=True, output_kind=kind))
        boom = eng.add_request(prompt_token_ids=[9, 8], params=SamplingParams(temperature=0, max_tokens=6,
                                                                              ignore_eos=True, output_kind=kind))
        eng.requests[boom].detokenizer = BoomDetokenizer(eng.tokenizer)
        finals = {v[0]: v for call in drive(eng, {}) for v in call if v[1]}
        got[kind] = finals[nan], finals[boom]
    for nan_out, boom_out in got.values():
        assert nan_out[6] == "error" and NONFINITE_LOGITS in nan_out[10]
        assert nan_out[2] == toks[: i + 1]  # the tokens before the step whose logits were NaN, in both kinds
        assert boom_out[6] == "error" and "emitting its output failed" in boom_out[10]
    # cumulative: the third token's text failed in its step (two tokens sent); final_only: the text is made at
    # the end, so only the last step's token is rolled back, and the text is what the detokenizer made.
    assert got["cumulative"][1][2] == fake_generate([9, 8], 2, V)
    assert got["final_only"][1][2] == fake_generate([9, 8], 5, V)


def test_output_kind_is_checked():
    with pytest.raises(RequestError, match=r"output_kind = 'deltas'.*'cumulative' or 'delta' or 'final_only'"):
        SamplingParams(output_kind="deltas").validate()
    eng = make_engine(False)
    with pytest.raises(RequestError, match="output_kind"):
        eng.add_request(prompt_token_ids=[1, 2], params={"output_kind": None})
    assert not eng.has_unfinished()


def test_final_only_makes_no_output_object_while_a_request_runs(monkeypatch):
    params = with_kind(mixed_params(), "final_only")  # mixed_params runs an engine of its own: before counting
    made = []
    real = Request.make_output

    def counting(self, *a, **kw):
        made.append(self.request_id)
        return real(self, *a, **kw)

    monkeypatch.setattr(Request, "make_output", counting)
    eng = make_engine(True)
    add_all(params)(eng)
    finals = [v for call in drive(eng, {}) for v in call]
    assert sorted(made) == sorted(v[0] for v in finals) == sorted(f"r{i}" for i in range(8))


def test_an_aborted_final_only_request_has_the_text_of_every_token_it_made():
    """Sampled over V = 300 (ids 128..255 are parts of multi-byte characters), many requests are aborted with a
    character incomplete: its text is made to the last token and flushed, as a cumulative request's is."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(24)]
    script = {k: (lambda eng, k=k: [eng.abort(f"r{i}") for i in range(24) if i % 6 == k - 2] and None)
              for k in range(2, 8)}
    runs = run_kinds(lambda: make_engine(False, max_num_seqs=24), params, script)
    check_kinds(runs)
    aborted = [v for call in runs["final_only"] for v in call if v[6] == "abort"]
    assert len(aborted) >= 20 and sum("\ufffd" in v[3] for v in aborted) >= 3
