"""The pure-decode fast paths (Scheduler._schedule_decodes, the engine's plain-decode step, gather_decodes in
ModelRunner.prepare) against the general paths they shortcut, on random add / step / abort schedules: every
step's Schedule, outputs, block tables, free queue and counters must be the same. The general engine has the fast
paths turned off (its scheduler's _schedule_decodes returns None; gather_decodes returns None while it steps)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kiln.runtime.model_runner as runner_mod
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import NgramDrafter
from kiln.tokenizer import ByteTokenizer
from tests.support.fake_step import FakeStepModel, fake_config

V = 300
EOS = 7


def make(cfg: dict, fast: bool) -> tuple[Engine, list, list]:
    """An engine, the list its scheduler's schedules are recorded in (as plain tuples, when made) and the list of
    their plain_decodes flags (set by the fast path only)."""
    kw = {}
    model = FakeStepModel(V)
    if cfg["speculate"]:
        from tests.support.speculative import reference_verify  # kiln.build is heavy: only these cases need it

        model.verify = reference_verify
        kw = {"drafter": NgramDrafter(n=2, k=2), "speculation_max_batch": 2}
    eng = Engine(model, ByteTokenizer(V, eos_token_ids=(EOS,)), fake_config(64, vocab=V), block_size=cfg["block"],
                 num_blocks=64 // cfg["block"] + 1 + cfg["extra"], max_num_seqs=cfg["seqs"],
                 max_num_batched_tokens=cfg["budget"], enable_prefix_caching=cfg["prefix"],
                 scheduling_policy=cfg["policy"], **kw)
    eng.runner.decode_numpy_min_seqs = 1  # the batches here are small
    seen: list = []
    flags: list[bool] = []
    schedule = eng.scheduler.schedule

    def recorded():
        sched = schedule()
        seen.append(([(s.request.request_id, s.start, s.num_new, s.sample, s.num_drafts) for s in sched.seqs],
                     [r.request_id for r in sched.preempted]))
        flags.append(sched.plain_decodes)
        return sched

    eng.scheduler.schedule = recorded
    if not fast:
        eng.scheduler._schedule_decodes = lambda: None
    return eng, seen, flags


@contextlib.contextmanager
def general_prepare(on: bool):
    if not on:
        yield
        return
    real = runner_mod.gather_decodes
    runner_mod.gather_decodes = lambda *a, **k: None
    try:
        yield
    finally:
        runner_mod.gather_decodes = real


def view(out) -> tuple:
    c = out.outputs[0]
    return (out.request_id, out.finished, c.token_ids, c.text, c.delta_text, c.finish_reason, c.stop_reason,
            c.logprobs, out.error)


def state(eng: Engine) -> tuple:
    bm, sch = eng.block_manager, eng.scheduler
    return ({k: list(v) for k, v in bm.tables.items()}, list(bm.free_queue), dict(bm.cached), sch.num_preemptions,
            sch.num_spec_off_steps, [r.request_id for r in sch.running], [r.request_id for r in sch.waiting],
            {r: q.num_computed_tokens for r, q in eng.requests.items()}, eng.num_generated_tokens, eng.num_steps,
            eng.num_batched_tokens)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=9),
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=1),
    SamplingParams(temperature=0, max_tokens=8, logprobs=2),
    SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(5, 9), ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=11, stop=["ab"]),
    SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=7),
]

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(0, len(PARAMS) - 1)),
    st.tuples(st.just("step"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.booleans()),
), min_size=1, max_size=25)
configs = st.fixed_dictionaries({
    "block": st.sampled_from([2, 4]), "extra": st.integers(0, 12), "seqs": st.integers(1, 6),
    "budget": st.integers(3, 24), "prefix": st.booleans(), "policy": st.sampled_from(["continuous", "continuous",
                                                                                     "static"]),
    "speculate": st.booleans(),
})  # fmt: skip


def run_both(cfg: dict, script: list) -> list[int]:
    """Drive both engines through the script and compare them after every call; the fast engine's plain-decode
    step count."""
    engines = [make(cfg, fast=True), make(cfg, fast=False)]
    ids: list[str] = []
    for op, a, b in [*script, ("drain", 0, 0)]:
        results = []
        for (eng, seen, _), general in zip(engines, (False, True), strict=True):
            got: list = []
            if op == "add":
                p = PARAMS[b]
                got.append(eng.add_request(prompt_token_ids=a, params=p))
            elif op == "abort":
                if ids:
                    got.append(eng.abort(ids[a % len(ids)], notify=b))
            else:
                steps = a if op == "step" else 200
                with general_prepare(general):
                    for _ in range(steps):
                        if op == "drain" and not eng.has_unfinished():
                            break
                        got.append([view(o) for o in eng.step()])
            eng.block_manager.check_invariants()
            results.append((got, list(seen), state(eng)))
        assert results[0] == results[1], op
        if op == "add":
            ids.append(results[0][0][0])
    assert not engines[0][0].has_unfinished()
    return [sum(engines[0][2]), sum(engines[1][2])]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, script=ops)
def test_the_fast_paths_do_what_the_general_paths_do(cfg, script):
    fast_steps, general_steps = run_both(cfg, script)
    assert general_steps == 0  # the general engine never took the fast path
    event("the fast engine took the fast path" if fast_steps else "no plain-decode step")


@pytest.mark.parametrize("speculate", [False, True])
def test_a_steady_decode_batch_takes_the_fast_paths(speculate):
    """The comparison above is not vacuous: a batch of plain decodes goes through the fast paths."""
    cfg = {"block": 4, "extra": 20, "seqs": 4, "budget": 24, "prefix": True, "policy": "continuous",
           "speculate": speculate}
    script = [("add", [1, 2, 3, i], 1) for i in range(4)] + [("step", 12, 0)]
    fast_steps, _ = run_both(cfg, script)
    assert fast_steps >= 10
    eng, _, flags = make(cfg, fast=True)
    calls = []
    real = runner_mod.gather_decodes

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    runner_mod.gather_decodes = counted
    try:
        for i in range(4):
            eng.add_request(prompt_token_ids=[1, 2, 3, i], params=PARAMS[1])
        for _ in range(6):
            eng.step()
    finally:
        runner_mod.gather_decodes = real
    assert calls.count(True) == 5 and flags == [False] + [True] * 5
    if speculate:  # four decodes are more than speculation_max_batch = 2: counted as off, as the general path does
        assert eng.scheduler.num_spec_off_steps == 5
