"""A failure inside the runtime ends only the requests it concerns (fault isolation) and, unless it is a KilnError
(the user's doing), is logged once on the `kiln` loggers with its traceback and "this is a bug in kiln": the
request's one-line error alone would lose where it happened. One case per place the runtime catches: each injects
an exception there and checks the request's error text, the log record, and that the record's traceback starts in
that place's function."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import kiln.runtime.batch_sampler as batch_sampler
import kiln.runtime.outputs as outputs
import kiln.runtime.plain_rows as plain_rows
import kiln.runtime.prompt_logprobs as prompt_logprobs
from kiln.errors import KilnError
from kiln.runtime.batch_sampler import LaunchedSample
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.prompt_logprobs import LaunchedPrompt
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import NgramDrafter
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_run import finish_all
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate

V = 97
GREEDY = SamplingParams(temperature=0, max_tokens=4)
EVERY_ID = list(range(V))  # a prompt in which the n-gram drafter finds every last token: each decode has drafts


class Boom(Exception):
    """A failure no input should cause: a bug."""


class UserBoom(KilnError):
    """A failure the user caused."""


def boom(exc: type[Exception]):
    """The injected failure: the last frame of every logged traceback."""
    raise exc("kaboom")


@dataclass
class Case:
    """setup(monkeypatch, exc) -> (engine, {request id: None (untouched) or (what failed, finish_reason)}); site:
    (file, function) where the runtime catches the failure."""

    setup: Callable
    site: tuple[str, str]


def _engine(**kw) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return Engine(FakeStepModel(V), ByteTokenizer(V), fake_config(64), **kw)


def _spec_engine(verify: Callable | None = None) -> Engine:
    from tests.support.speculative import reference_verify  # kiln.build is heavy: only these cases need it

    model = FakeStepModel(V)
    model.verify = verify or reference_verify
    return Engine(model, None, fake_config(128), block_size=4, num_blocks=64, drafter=NgramDrafter(n=2, k=2))


def _once(exc: type[Exception], real: Callable) -> Callable:
    """real, except that its first call raises."""
    calls = []

    def patched(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            boom(exc)
        return real(*args, **kw)

    return patched


def sampling_a_row(mp, exc):
    mp.setattr(batch_sampler, "sample_rows", lambda *a, **k: boom(exc))  # only rows that sample (not greedy) call it
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0.7, seed=1, max_tokens=4))
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    return eng, {victim: ("sampling failed", "error"), other: None}


def launching_the_batch(mp, exc):
    mp.setattr(plain_rows, "launch_batch", _once(exc, plain_rows.launch_batch))
    eng = _engine()
    a = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    b = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    return eng, {a: ("sampling the batch failed", "error"), b: ("sampling the batch failed", "error")}  # logged once


def copying_the_batch(mp, exc):
    mp.setattr(LaunchedSample, "result", _once(exc, LaunchedSample.result))
    eng = _engine()
    a = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    b = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    return eng, {a: ("sampling the batch failed", "error"), b: ("sampling the batch failed", "error")}


def launching_prompt_scores(mp, exc):
    mp.setattr(prompt_logprobs, "queue_host_copy", _once(exc, prompt_logprobs.queue_host_copy))
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=3,
                                                                             prompt_logprobs=1))
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    return eng, {victim: ("scoring the prompt failed", "error"), other: None}


def copying_prompt_scores(mp, exc):
    mp.setattr(LaunchedPrompt, "values", _once(exc, LaunchedPrompt.values))
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=3,
                                                                             prompt_logprobs=1))
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    return eng, {victim: ("scoring the prompt failed", "error"), other: None}


def _stop_of_failing_for(exc, victim: Detokenizer, after: int = 0):
    """stop_of, raising for the victim's token after its first `after` ones."""
    real = outputs.stop_of

    def stop_of(det, tok, num_output, *rest):
        if det is victim and num_output > after:
            boom(exc)
        return real(det, tok, num_output, *rest)

    return stop_of


def appending_a_token(mp, exc):
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    mp.setattr(outputs, "stop_of", _stop_of_failing_for(exc, eng.requests[victim].detokenizer))
    return eng, {victim: ("emitting its output failed", "error"), other: None}


class _BadText(Detokenizer):
    def add(self, token_id: int) -> str | None:
        boom(self.exc)


class _BadFlush(Detokenizer):
    def flush(self) -> None:
        boom(self.exc)


class _BadVisible(Detokenizer):
    def visible_text(self, final: bool) -> str:
        boom(self.exc)


def _give(eng: Engine, rid: str, cls: type[Detokenizer], exc) -> None:
    det = cls(eng.tokenizer)
    det.exc = exc
    eng.requests[rid].detokenizer = det


def making_its_text(mp, exc):
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    _give(eng, victim, _BadText, exc)
    return eng, {victim: ("emitting its output failed", "error"), other: None}


def flushing_its_text(mp, exc):
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    _give(eng, victim, _BadFlush, exc)
    return eng, {victim: ("flushing its text failed", "length"), other: None}  # it still ends as asked


def aborting(mp, exc):
    eng = _engine()
    victim = eng.add_request(prompt_token_ids=[1, 2], params=GREEDY)
    other = eng.add_request(prompt_token_ids=[3, 4], params=GREEDY)
    _give(eng, victim, _BadVisible, exc)
    assert eng.abort(victim)  # its output is made now: the text read fails
    return eng, {victim: ("emitting its output failed", "abort"), other: None}


def drafting(mp, exc):
    mp.setattr(NgramDrafter, "propose", _once(exc, NgramDrafter.propose))
    eng = _spec_engine()
    rid = eng.add_request(prompt_token_ids=EVERY_ID, params=GREEDY)
    return eng, {rid: None}  # the drafter is an optimisation: the step decodes without drafts


def verifying(mp, exc):
    eng = _spec_engine(verify=lambda batch: boom(exc))
    victim = eng.add_request(prompt_token_ids=EVERY_ID, params=GREEDY)
    other = eng.add_request(prompt_token_ids=[3, 4], params=SamplingParams(temperature=0, max_tokens=4,
                                                                         speculate=False))
    return eng, {victim: ("verifying the drafts failed", "error"), other: None}


def appending_accepted_drafts(mp, exc):
    eng = _spec_engine()
    victim = eng.add_request(prompt_token_ids=EVERY_ID, params=GREEDY)
    # the first token comes from the prefill (plain rows); the next ones from verification
    mp.setattr(outputs, "stop_of", _stop_of_failing_for(exc, eng.requests[victim].detokenizer, after=1))
    return eng, {victim: ("emitting its output failed", "error")}


CASES = {
    "sampling a row": Case(sampling_a_row, ("batch_sampler.py", "launch_batch")),
    "launching the batch": Case(launching_the_batch, ("plain_rows.py", "launch_plain")),
    "copying the batch": Case(copying_the_batch, ("plain_rows.py", "take_plain")),
    "launching prompt scores": Case(launching_prompt_scores, ("prompt_logprobs.py", "launch_prompt")),
    "copying prompt scores": Case(copying_prompt_scores, ("prompt_logprobs.py", "take_prompt")),
    "appending a token": Case(appending_a_token, ("outputs.py", "take_rows")),
    "making its text": Case(making_its_text, ("outputs.py", "emit_one")),
    "flushing its text": Case(flushing_its_text, ("outputs.py", "flush")),
    "aborting": Case(aborting, ("outputs.py", "output")),
    "drafting": Case(drafting, ("spec_step.py", "propose")),
    "verifying": Case(verifying, ("spec_step.py", "verify")),
    "appending accepted drafts": Case(appending_accepted_drafts, ("spec_step.py", "verify")),
}


def check_outcome(final: dict, want: dict, exc: type[Exception]) -> None:
    for rid, failed in want.items():
        out = final[rid]
        if failed is None:  # untouched by the failure
            assert out.error is None and out.outputs[0].finish_reason == "length", (rid, out.error)
            continue
        what, reason = failed
        # the request's error text as before: what failed, the exception's type and message
        assert f"{what} ({exc.__name__}: kaboom)" in out.error and repr(rid) in out.error, out.error
        assert out.outputs[0].finish_reason == reason


@pytest.mark.parametrize("name", list(CASES))
def test_a_bug_is_logged_once_with_its_traceback_and_ends_only_its_requests(name, monkeypatch, caplog):
    case = CASES[name]
    caplog.set_level(logging.DEBUG, logger="kiln")
    eng, want = case.setup(monkeypatch, Boom)
    check_outcome(finish_all(eng, 100), want, Boom)

    logged = [r for r in caplog.records if r.exc_info is not None]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    (rec,) = logged
    assert rec.name.startswith("kiln.") and rec.levelno == logging.ERROR
    assert "this is a bug in kiln" in rec.getMessage() and "(Boom: kaboom)" in rec.getMessage()
    assert rec.exc_info[0] is Boom
    frames = traceback.extract_tb(rec.exc_info[2])
    assert frames[-1].name == "boom"  # the traceback reaches the failure itself
    assert (frames[0].filename.rsplit("/", 1)[-1], frames[0].name) == case.site  # and starts where it was caught

    # The engine goes on: a new request is served in full.
    again = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=3))
    assert finish_all(eng, 100)[again].outputs[0].token_ids == fake_generate([1, 2, 3], 3, V)


@pytest.mark.parametrize("name", list(CASES))
def test_a_kiln_error_keeps_its_one_line_and_logs_no_traceback(name, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="kiln")
    eng, want = CASES[name].setup(monkeypatch, UserBoom)
    check_outcome(finish_all(eng, 100), want, UserBoom)
    assert not [r for r in caplog.records if r.exc_info is not None or "bug in kiln" in r.getMessage()]


def test_the_drafters_failure_is_still_a_warning_naming_it(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="kiln")
    eng, _ = drafting(monkeypatch, UserBoom)
    finish_all(eng, 100)
    assert eng.stats.spec_drafter_failures >= 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the drafter failed (UserBoom: kaboom); this step decodes without speculation" in warned


def test_a_drafter_that_keeps_failing_logs_its_traceback_once(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="kiln")
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, reserved: boom(Boom))
    eng = _spec_engine()
    rid = eng.add_request(prompt_token_ids=EVERY_ID, params=GREEDY)
    assert finish_all(eng, 100)[rid].outputs[0].finish_reason == "length"  # served without drafts
    assert eng.stats.spec_drafter_failures >= 2
    traced = [r for r in caplog.records if r.exc_info is not None]
    assert len(traced) == 1 and "bug in kiln" in traced[0].getMessage()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == eng.stats.spec_drafter_failures - 1
