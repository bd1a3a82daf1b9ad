"""Engine(overlap_outputs=True) makes each step's outputs during the next step's model call: the outputs must be
exactly those without it (tokens, text, deltas, finish and stop reasons, logprobs, errors), one step() call later,
with the same model calls, under stop strings, eos, stop ids, logprobs, penalties, preemption, aborts mid-run, a
failing detokenizer and speculative decoding. Runs on the fake step model (tests/support/fake_step.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_machines import speculative_engine
from tests.support.fake_step import fake_generate
from tests.support.faulty_parts import BoomDetokenizer
from tests.support.overlap_engine import (
    OverlapMachine,
    V,
    add_all,
    both,
    drive,
    make_engine,
    mixed_params,
    per_request,
    prompt,
    view,
)


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
