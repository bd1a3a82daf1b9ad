"""Engine(overlap_outputs=True) makes each step's outputs during the next step's model call: the outputs must be
exactly those without it (tokens, text, deltas, finish and stop reasons, logprobs, errors), one step() call later,
with the same model calls, under stop strings, eos, stop ids, logprobs, penalties, preemption, aborts mid-run, a
failing detokenizer and speculative decoding. Runs on the fake step model (tests/support/fake_step.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.runtime.test_engine_faults import BoomDetokenizer
from tests.runtime.test_engine_logic import EngineMachine, speculative_engine
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


def test_outputs_are_the_same_one_call_later_with_the_same_model_calls():
    params = mixed_params()
    off, on, e_off, e_on = both(add_all(params))
    assert on == [[], *off]  # every call's outputs, in order, one call later
    assert (e_on.model.calls, e_on.model.batch_sizes) == (e_off.model.calls, e_off.model.batch_sizes)
    final = {v[0]: v for v in on[-1] + [v for c in on for v in c if v[1]]}
    reasons = {rid: (v[6], v[7]) for rid, v in final.items()}
    assert reasons["r0"][0] == "length" and reasons["r4"][0] == "length"
    assert reasons["r2"][0] == "stop" and reasons["r3"][0] == "stop" and isinstance(reasons["r2"][1], str)
    assert reasons["r7"] == ("stop", params[7].stop_token_ids[0])
    assert final["r1"][8] is not None and len(final["r1"][8]) == len(final["r1"][2])  # logprobs per token
    assert any(ord(ch) > 127 for v in final.values() for ch in v[3])  # multi-byte text went through the windows


def test_preemption_and_chunked_prefill_give_the_same_outputs():
    params = mixed_params() * 2
    off, on, e_off, e_on = both(add_all(params), num_blocks=18, max_num_seqs=6, max_num_batched_tokens=10)
    assert e_off.scheduler.num_preemptions > 0 and e_on.scheduler.num_preemptions == e_off.scheduler.num_preemptions
    assert on == [[], *off]


def test_aborts_mid_run_give_the_same_outputs():
    params = mixed_params()

    def abort(*rids: str, notify: bool = True) -> Callable[[Engine], None]:
        return lambda eng: [eng.abort(r, notify=notify) for r in rids] and None

    def add_late(eng: Engine) -> None:
        eng.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(temperature=0, max_tokens=6),
                        request_id="late")

    # r0 and r5 mid-run (r5 right after its first token), r6 quietly, "late" right after it was added.
    script = {2: abort("r5"), 3: add_late, 4: abort("r0", "late"), 5: abort("r6", notify=False)}
    off, on, *_ = both(add_all(params), script, max_num_seqs=6)
    runs = per_request(on)
    assert runs["r0"][-1][6] == "abort" and len(runs["r0"][-1][2]) == 4 and runs["r5"][-1][6] == "abort"
    assert runs["late"][-1][6] == "abort" and not any(v[1] for v in runs["r6"])


def test_abort_of_a_request_that_already_finished_returns_false_and_its_output_still_comes():
    eng = make_engine(True)
    rid = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=1))
    assert eng.step() == []  # its only token is sampled; the output is made during the next call
    assert not eng.abort(rid) and eng.has_unfinished()
    (out,) = eng.step()
    assert out.finished and out.outputs[0].finish_reason == "length" and not eng.has_unfinished()


def test_a_failing_detokenizer_ends_only_its_request_the_same_way():
    """Boom raises on a request's third token: mid-run, on the token that ends it (max_tokens 3), with stop
    strings (detokenized at once), and in flush when it ends after two tokens."""
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=8, stop=["never-written"]),
              SamplingParams(temperature=0, max_tokens=2), SamplingParams(temperature=0.9, max_tokens=7, seed=4),
              SamplingParams(temperature=0, max_tokens=9)]

    def add(eng: Engine) -> None:
        add_all(params)(eng)
        for rid in ("r0", "r1", "r2", "r3"):
            req = eng.requests[rid]
            req.detokenizer = BoomDetokenizer(eng.tokenizer, req.params.stop)

    off, on, e_off, e_on = both(add)
    final = {rid: runs[-1] for rid, runs in per_request(on).items()}
    for rid in ("r0", "r1", "r2"):
        assert final[rid][6] == "error" and "UnicodeDecodeError" in final[rid][10] and len(final[rid][2]) == 2
    assert final["r3"][6] == "length" and "flush boom" in final["r3"][10]
    assert final["r4"][6] == final["r5"][6] == "length" and final["r5"][2] == fake_generate(prompt(5), 9, V)
    # r0's failure is found while the next step runs: the row computed for it then is dropped, nothing emitted
    assert sum(e_on.model.batch_sizes) == sum(e_off.model.batch_sizes) + 1


def test_speculative_decoding_gives_the_same_outputs():
    def run(overlap: bool, stops: dict[int, str]) -> tuple[dict[str, list[tuple]], Engine]:
        eng = speculative_engine("own")
        eng.tokenizer = ByteTokenizer(97)
        eng.overlap_outputs = overlap
        for i in range(8):
            p = [(i + j) % 5 for j in range(3 + i)]
            params = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=12 + i,
                                    stop=[stops[i]] if i in stops else [])
            eng.add_request(prompt_token_ids=p, params=params, request_id=f"s{i}")
            eng.requests[f"s{i}"].detokenizer = Detokenizer(eng.tokenizer, params.stop)
        return per_request(drive(eng, {})), eng

    plain, _ = run(False, {})
    stops = {i: plain[f"s{i}"][-1][3][5:7] for i in (1, 3, 5)}  # text each (greedy) meets mid-way
    off, e_off = run(False, stops)
    on, e_on = run(True, stops)
    assert on == off and e_on.stats.spec_accepted == e_off.stats.spec_accepted > 0
    assert [off[f"s{i}"][-1][6:8] for i in stops] == [("stop", s) for s in stops.values()]


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
test_no_leak_under_random_add_step_abort_with_overlap = OverlapMachine.TestCase


def test_llm_generate_and_streams_are_the_same_with_overlap():
    """LLM.generate and interleaved generate_stream generators on tiny-llama (reference ops), overlap off and on,
    and with async scheduling (tests/runtime/test_engine_async.py)."""
    from kiln import LLM

    llm = LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)
    prompts = ["Hello", "Once upon a time", "x"]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=9, seed=5, logprobs=1),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]

    def run(overlap: bool, ahead: bool = False) -> tuple[list[tuple], list[list[tuple]]]:
        llm.engine.overlap_outputs = overlap
        llm.engine.async_scheduling = ahead
        final = [view(o) for o in llm.generate(prompts, params)]
        a, b = llm.generate_stream(prompts[:2], params[:2]), llm.generate_stream(prompts[2:], params[2:])
        streamed: list[list[tuple]] = [[], []]
        live = {0: a, 1: b}
        while live:  # one output of each stream in turn
            for k in list(live):
                out = next(live[k], None)
                if out is None:
                    del live[k]
                else:
                    streamed[k].append(view(out))
        assert not llm.engine.has_unfinished()
        # Each request's outputs, in order (how a stream interleaves its requests depends on when steps run).
        by_request = per_request(streamed)
        runs = [[v[1:] for v in r] for _, r in sorted(by_request.items(), key=lambda kv: int(kv[0]))]
        return [v[1:] for v in final], runs

    assert run(True) == run(False) == run(True, ahead=True)
    assert llm.engine.stats.num_steps_ahead > 0


def test_a_model_call_that_raises_keeps_the_last_steps_outputs(monkeypatch):
    eng = make_engine(True)
    rid = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=4))
    assert eng.step() == []
    lost = RuntimeError("device lost")
    monkeypatch.setattr(eng.runner, "execute", lambda sched, prompt=None: (_ for _ in ()).throw(lost))
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    monkeypatch.undo()
    assert eng.has_unfinished()
    outs = eng.step()  # the output of the step before the failure comes with the next call
    assert [(o.request_id, o.outputs[0].token_ids) for o in outs] == [(rid, fake_generate([1, 2, 3], 1, V))]
