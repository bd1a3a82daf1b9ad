"""Engine(async_scheduling=True) schedules and launches a decode step before the last one's sampled ids are read
back (their input tokens copied on the device): its outputs must be those of overlap_outputs alone (tokens, text,
deltas, finish and stop reasons, logprobs, errors), call for call where no request stops on a token the host has
not seen yet, and request for request otherwise (a row computed for a request that stopped is dropped). Runs on
the fake step model (tests/support/fake_step.py), which checks every slot it reads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import settings

from kiln.errors import KilnError
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_machines import speculative_engine
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate
from tests.support.faulty_parts import BoomDetokenizer
from tests.support.overlap_engine import (
    EOS,
    OverlapMachine,
    Script,
    V,
    add_all,
    drive,
    make_engine,
    mixed_params,
    per_request,
    prompt,
)


def engine(ahead: bool, **kw) -> Engine:
    eng = make_engine(True, async_scheduling=ahead, **kw)
    assert eng.overlap_outputs and eng.async_scheduling is ahead
    return eng


def run(ahead: bool, add: Callable[[Engine], None], script: Script | None = None, **kw) -> tuple[list, Engine]:
    eng = engine(ahead, **kw)
    add(eng)
    return drive(eng, script or {}), eng


def no_early_stops() -> list[SamplingParams]:
    """Requests that end on max_tokens only: the host knows before each step who runs, so the schedules match."""
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=1, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.1, top_p=0.9, max_tokens=15, seed=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=11, seed=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
    ]


def test_without_early_stops_every_call_and_model_call_is_the_same():
    add = add_all(no_early_stops())
    off, e_off = run(False, add)
    on, e_on = run(True, add)
    assert on == off
    assert (e_on.model.calls, e_on.model.batch_sizes) == (e_off.model.calls, e_off.model.batch_sizes)
    # Every step but the first (the prompts' prefill, scheduled from host tokens) was launched ahead: the prefill's
    # chunks are all sampled, so its successor is known without its tokens.
    assert e_on.stats.num_steps_ahead == e_on.num_steps - 1 and e_off.stats.num_steps_ahead == 0
    assert e_on.num_generated_tokens == e_off.num_generated_tokens == sum(p.max_tokens for p in no_early_stops())


def test_mixed_requests_give_the_same_outputs_and_a_row_past_a_stop_is_dropped():
    """Stop strings, stop ids, eos, logprobs and seeds; then with a repetition penalty too (its sampler needs the
    token history on the host, so no step is launched ahead while it runs)."""
    params = mixed_params()
    assert params[5].repetition_penalty != 1.0
    add = add_all(params[:5] + params[6:])
    off, e_off = run(False, add)
    on, e_on = run(True, add)
    assert per_request(on) == per_request(off)
    assert e_on.num_generated_tokens == e_off.num_generated_tokens and e_on.stats.num_steps_ahead > 0
    # Requests that stopped on a token the host had not seen had one more row computed, never emitted.
    assert sum(e_on.model.batch_sizes) > sum(e_off.model.batch_sizes)
    off, e_off = run(False, add_all(params))
    on, e_on = run(True, add_all(params))
    assert per_request(on) == per_request(off)
    penalty_steps = len(per_request(on)["r5"])
    assert e_on.num_steps - e_on.stats.num_steps_ahead >= penalty_steps


def test_a_stop_token_costs_exactly_one_dropped_row():
    toks = fake_generate(prompt(0), 12, V)
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(toks[4],)),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    add = add_all(params)
    off, e_off = run(False, add)
    on, e_on = run(True, add)
    assert per_request(on) == per_request(off)
    final = per_request(on)["r0"][-1]
    assert final[2] == toks[:5] and final[6:8] == ("stop", toks[4])
    assert sum(e_on.model.batch_sizes) == sum(e_off.model.batch_sizes) + 1


@pytest.mark.parametrize("early_stops", [True, False])
def test_preemption_and_chunked_prefill_give_the_same_outputs(early_stops):
    """With and without early stops (and a repetition penalty): request for request. Not call for call: a step
    scheduled ahead admits while the blocks of requests ending on their token in flight are still held."""
    add = add_all(mixed_params() * 2 if early_stops else no_early_stops() * 3)
    kw = dict(num_blocks=18, max_num_seqs=6 if early_stops else 8, max_num_batched_tokens=10 if early_stops else 12)
    off, e_off = run(False, add, **kw)
    on, e_on = run(True, add, **kw)
    assert e_off.scheduler.num_preemptions > 0 and e_on.stats.num_steps_ahead > 0
    assert per_request(on) == per_request(off)


def test_padded_decode_batches_take_their_tokens_on_the_device():
    """pad_decode_batches runs CUDA graphs' padded shapes eagerly: the ahead step's tokens go into a padded batch."""
    add = add_all(no_early_stops())
    off, e_off = run(False, add, pad_decode_batches=True, max_num_seqs=8)
    on, e_on = run(True, add, pad_decode_batches=True, max_num_seqs=8)
    assert on == off and e_on.model.batch_sizes == e_off.model.batch_sizes
    assert e_on.runner.graph_stats.padded_decodes > 0 and e_on.stats.num_steps_ahead > 0


def test_aborts_and_late_arrivals_give_the_same_outputs():
    """An abort takes the step in flight in first (so it sees what overlap_outputs would); a request added while a
    step is in flight is admitted by the next call, as it would be without async scheduling."""

    def abort(*rids: str, notify: bool = True) -> Callable[[Engine], None]:
        return lambda eng: [eng.abort(r, notify=notify) for r in rids] and None

    def add_late(eng: Engine) -> None:
        eng.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(temperature=0, max_tokens=6),
                        request_id="late")

    script = {3: abort("r1"), 4: add_late, 6: abort("r0", "late"), 7: abort("r5", notify=False),
              9: abort("r3")}  # r3 (one token) is done by then: False, its output already came
    add = add_all(no_early_stops())
    off, e_off = run(False, add, script, max_num_seqs=6)
    on, e_on = run(True, add, script, max_num_seqs=6)
    assert on == off and e_on.stats.num_steps_ahead > 0
    runs = per_request(on)
    assert runs["r0"][-1][6] == "abort" and runs["r1"][-1][6] == "abort" and runs["late"][-1][6] == "abort"
    assert not any(v[1] for v in runs["r5"])


def test_a_step_that_admits_a_request_is_left_in_flight_too():
    """A late request's prefill runs beside the decodes; every chunk of that step is sampled, so the step after it
    is launched ahead of its tokens as well, with the same outputs call for call."""
    froms: list[int] = []

    def late(eng: Engine) -> None:
        eng.add_request(prompt_token_ids=prompt(9), params=SamplingParams(temperature=0, max_tokens=7,
                                                                          ignore_eos=True), request_id="late")
        launch = eng.ahead.launch_ahead

        def spy():
            longest = max(s.num_new for s in eng.ahead.flight.seqs)
            got = launch()
            if got is not None:
                froms.append(longest)
            return got

        eng.ahead.launch_ahead = spy

    add = add_all(no_early_stops()[:3])
    off, _ = run(False, add, {3: late})
    on, e_on = run(True, add, {3: late})
    assert on == off and per_request(on)["late"][-1][2] == fake_generate(prompt(9), 7, V)
    assert max(froms) == len(prompt(9))  # launched ahead of the step that prefilled "late"
    # every step but the first prefill: the step that admits "late" too (its whole prompt fits the step)
    assert e_on.stats.num_steps_ahead == e_on.num_steps - 1


def test_a_failing_detokenizer_ends_only_its_request():
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, stop=["never-written"], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]

    def add(eng: Engine) -> None:
        add_all(params)(eng)
        for rid in ("r0", "r1", "r2"):
            req = eng.requests[rid]
            req.detokenizer = BoomDetokenizer(eng.tokenizer, req.params.stop)

    off, _ = run(False, add)
    on, e_on = run(True, add)
    assert per_request(on) == per_request(off) and e_on.stats.num_steps_ahead > 0
    final = {rid: runs[-1] for rid, runs in per_request(on).items()}
    assert all(final[r][6] == "error" and len(final[r][2]) == 2 for r in ("r0", "r1", "r2"))
    assert final["r3"][6] == "length" and final["r3"][2] == fake_generate(prompt(3), 9, V)


def test_a_model_call_that_raises_ahead_keeps_the_step_in_flight(monkeypatch):
    eng = engine(True)
    rid = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=5))
    outs = eng.step() + eng.step()  # the prefill (taken in), then a decode left in flight
    assert eng.ahead.flight is not None and len(outs) == 1
    execute = eng.runner.execute
    monkeypatch.setattr(eng.runner, "execute", lambda sched, tokens=None: (_ for _ in ()).throw(RuntimeError("lost")))
    with pytest.raises(RuntimeError, match="lost"):
        eng.step()
    monkeypatch.setattr(eng.runner, "execute", execute)
    outs += [o for _ in range(6) for o in eng.step()]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == fake_generate([1, 2, 3], 5, V)
    assert [len(o.outputs[0].delta_token_ids) for o in outs] == [1] * 5 and not eng.has_unfinished()
    assert outs[0].request_id == rid


def test_the_input_tokens_come_from_the_device_not_the_host(monkeypatch):
    """A step launched ahead gathers no input tokens on the host (they are not there yet): its staged tokens are
    whatever the last step left there, and the outputs still follow the oracle only because the device copy
    puts the sampled ids in."""
    from kiln.runtime import decode_batches

    seen = []
    real = decode_batches.gather_decodes

    def spy(*args, **kw):
        dec = real(*args, **kw)
        seen.append(dec.tokens is None)
        return dec

    monkeypatch.setattr("kiln.runtime.model_runner.gather_decodes", spy)
    eng = engine(True)
    for i in range(3):
        eng.add_request(prompt_token_ids=prompt(i), params=SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                        request_id=f"r{i}")
    final = {o.request_id: o.outputs[0].token_ids for o in eng.run()}
    assert final == {f"r{i}": fake_generate(prompt(i), 9, V) for i in range(3)}
    assert seen.count(True) == eng.stats.num_steps_ahead > 0


def test_async_scheduling_is_refused_where_it_is_not_built():
    cfg = fake_config(64, vocab=V)
    with pytest.raises(KilnError, match="overlap_outputs off"):
        Engine(FakeStepModel(V), ByteTokenizer(V, eos_token_ids=(EOS,)), cfg, block_size=4, num_blocks=40,
               overlap_outputs=False, async_scheduling=True)
    spec = speculative_engine("ngram")
    assert not spec.async_scheduling
    with pytest.raises(KilnError, match="speculative decoding"):
        spec.async_scheduling = True
    eng = engine(True)
    eng.overlap_outputs = False  # turns async scheduling off with it
    assert not eng.async_scheduling and not eng.overlap_outputs


class AsyncMachine(OverlapMachine):
    """The random add / step / abort churn with async scheduling: greedy outputs match the oracle, every request
    gets its final output, every block comes back, and no running request holds more than the blocks its
    next token needs (the step in flight's token counted as written)."""

    def __init__(self):
        super().__init__()
        self.engine.async_scheduling = True


AsyncMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_no_leak_under_random_add_step_abort_with_async_scheduling = AsyncMachine.TestCase


@pytest.mark.gpu
def test_cuda_graph_decodes_launched_ahead_give_the_same_tokens():
    """On CUDA, where it is on by default: tiny-llama's generated kernels, decodes replayed from CUDA graphs with
    their input tokens copied from the last step's sampled ids on the device; the same outputs as without it."""
    from kiln.build import load_model
    from kiln.compile.step import compile_step

    m = load_model("tiny-llama", device="cuda", seed=0)
    step = compile_step(m.gm, m.model, m.compile, device="cuda", use_kernels=True)
    # No prefix cache: the second run must compute its prompts as the first did, not reuse their blocks.
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=8, use_cuda_graphs=True, enable_prefix_caching=False)
    assert engine.async_scheduling and engine.overlap_outputs and engine.runner.graphs
    prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(3 + 5 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=9 + 3 * i, ignore_eos=True) for i in range(4)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=7, ignore_eos=True)]

    def go(ahead: bool) -> dict[str, tuple]:
        engine.async_scheduling = ahead
        ids = [engine.add_request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params, strict=True)]
        done = {o.request_id: (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.run()}
        return [done[i] for i in ids]

    before = (engine.stats.num_steps_ahead, engine.runner.graph_stats.decode_replays)
    on = go(True)
    assert engine.stats.num_steps_ahead > before[0] and engine.runner.graph_stats.decode_replays > before[1]
    assert go(False) == on
    assert [len(t) for t, _ in on] == [p.max_tokens for p in params]


def test_the_next_step_takes_its_tokens_in_its_own_order():
    """schedule_ahead lists the running requests in priority order, which a step with prefill chunks (listed after
    its decodes) may not follow: the tokens in flight are gathered by the indices it gives, drops and order."""
    from kiln.runtime.async_steps import AsyncSteps, InFlight
    from kiln.runtime.batch_sampler import LaunchedSample
    from kiln.runtime.schedule import Schedule, ScheduledSeq

    seen = []

    class Runner:
        def execute(self, sched, tokens):
            seen.append(tokens.tolist())
            return torch.zeros(len(sched.seqs), 5), sched.seqs

    class Sched:
        def __init__(self, keep):
            self.keep = keep

        def schedule_ahead(self, in_flight):
            seqs = [ScheduledSeq(in_flight[i].request, in_flight[i].start + 1, 1, True) for i in self.keep]
            return Schedule(seqs, plain_decodes=True), self.keep

    eng = engine(True)
    reqs = [eng.requests[eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=4))]
            for _ in range(3)]
    flight = [ScheduledSeq(r, 1, 1, True) for r in reqs]
    for keep in ([0, 1, 2], [2, 0, 1], [1, 2], [2]):
        ahead = AsyncSteps(Sched(keep), Runner(), eng.output)
        ahead.flight = InFlight(flight, LaunchedSample(None, [None] * 3, None, torch.tensor([10, 11, 12])))
        sched, last = ahead.launch_ahead()
        assert seen[-1] == [10 + i for i in keep] and last.seqs is flight
        assert [s.request for s in sched.seqs] == [reqs[i] for i in keep]


def test_schedule_ahead_follows_priority_order_and_admits_whole_prompts():
    eng = engine(True, max_num_seqs=5, max_num_batched_tokens=10)
    rids = [eng.add_request(prompt_token_ids=prompt(i), params=SamplingParams(max_tokens=5)) for i in range(3)]
    eng.step()  # the prefills, left in flight
    flight = eng.ahead.flight
    assert [s.request.request_id for s in flight.seqs] == rids
    reordered = [flight.seqs[i] for i in (2, 0, 1)]
    sched, keep = eng.scheduler.schedule_ahead(reordered)
    assert keep == [1, 2, 0] and [s.request.request_id for s in sched.seqs] == rids
    assert [s.start for s in sched.seqs] == [len(prompt(i)) for i in range(3)]
    late = eng.add_request(prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=3))  # a free seat
    sched, keep = eng.scheduler.schedule_ahead(flight.seqs)
    assert keep == [0, 1, 2] and not sched.plain_decodes
    assert [(s.request.request_id, s.start, s.num_new, s.sample) for s in sched.seqs][3:] == [(late, 0, 2, True)]
    eng.add_request(prompt_token_ids=[7] * 9, params=SamplingParams(max_tokens=3))  # 9 > the budget left (10 - 4)
    assert eng.scheduler.schedule_ahead([*flight.seqs, sched.seqs[3]]) is None  # it needs a partial chunk
