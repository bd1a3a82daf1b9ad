"""The two context rules in one place (kiln.runtime.prompt_limits): truncate_prompt_tokens (-1: max_model_len; over
max_model_len refused, as vLLM's LLM and server refuse it) and max_tokens (unset: the rest of the context; a default,
and in the engine any value, cut to it, as vLLM's get_max_tokens and its engine, which stops a request at
max_model_len), applied by the engine for every caller: Engine users, LLM and `kiln run` (the server's share, which
refuses a max_tokens the client sent past the context, is in tests/server/test_server_context_rules.py)."""

from __future__ import annotations

import pytest

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.prompt_limits import prompt_keep, resolve_max_tokens, truncate_prompt
from kiln.runtime.sampling_params import SamplingParams
from tests.support.fake_step import FakeStepModel, fake_config

V = 128


def engine(context: int = 32, **kw) -> Engine:
    return Engine(FakeStepModel(V), None, fake_config(context, V), block_size=4, **kw)


def run(e: Engine, prompt: list[int], params: SamplingParams, **kw):
    e.add_request(prompt_token_ids=prompt, params=params, **kw)
    return list(e.stream())[-1]


# ---- truncate_prompt_tokens ---------------------------------------------------------------------------------------


def test_prompt_keep_is_vllms_rule():
    assert prompt_keep(None, 32) is None
    assert prompt_keep(-1, 32) == 32  # -1: the last max_model_len
    assert prompt_keep(5, 32) == 5 and prompt_keep(32, 32) == 32
    with pytest.raises(RequestError, match="truncate_prompt_tokens = 33 is greater than max_model_len = 32") as e:
        prompt_keep(33, 32)
    assert e.value.param == "truncate_prompt_tokens"


def test_cutting_a_cut_prompt_changes_nothing():
    # the server cuts while tokenizing and the engine cuts again: both must give the same prompt
    ids = list(range(1, 41))
    once = truncate_prompt(ids, 7, 32)
    assert once == ids[-7:] and truncate_prompt(once, 7, 32) == once
    assert truncate_prompt(truncate_prompt(ids, -1, 32), -1, 32) == ids[-32:]


def test_the_engine_refuses_a_truncation_past_max_model_len():
    # LLM and Engine users took any k before (the server alone refused it); vLLM's LLM refuses it too
    e = engine(context=32)
    with pytest.raises(RequestError, match="greater than max_model_len = 32") as err:
        e.add_request(prompt_token_ids=[5] * 40, params=SamplingParams(max_tokens=2, truncate_prompt_tokens=33))
    assert err.value.param == "truncate_prompt_tokens" and not e.has_unfinished()
    out = run(e, [5] * 40, SamplingParams(max_tokens=2, ignore_eos=True, truncate_prompt_tokens=30))
    assert len(out.prompt_token_ids) == 30 and len(out.outputs[0].token_ids) == 2


def test_the_llm_refuses_a_truncation_past_max_model_len():
    from kiln import LLM

    llm = LLM("tiny-llama", device="cpu", seed=0, use_kernels=False, max_model_len=64)
    with pytest.raises(RequestError, match="truncate_prompt_tokens = 65 is greater than max_model_len = 64"):
        llm.generate(prompt_token_ids=[5] * 80, sampling_params=SamplingParams(max_tokens=1, truncate_prompt_tokens=65),
                     use_tqdm=False)
    out = llm.generate(prompt_token_ids=[5] * 80, use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=1, truncate_prompt_tokens=63))[0]
    assert out.prompt_token_ids == [5] * 63 and len(out.outputs[0].token_ids) == 1


# ---- max_tokens unset or a default ----------------------------------------------------------------------------------


def test_resolve_max_tokens_is_vllms_get_max_tokens():
    assert resolve_max_tokens(2, 30, 32) == 2  # given and fitting: as it is
    with pytest.raises(RequestError, match=r"prompt of 30 tokens \+ max_tokens 100 = 130 exceeds the model") as e:
        resolve_max_tokens(100, 30, 32)  # given past the context: refused (vLLM's server, `kiln run`) ...
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert resolve_max_tokens(100, 30, 32, cut=True) == 2  # ... or cut to it (vLLM's engine, behind LLM)
    assert resolve_max_tokens(None, 30, 32) == 2  # unset: the rest of the context
    assert resolve_max_tokens(5, 20, 32, is_default=True) == 5  # a default that fits
    assert resolve_max_tokens(50, 20, 32, is_default=True) == 12  # a default cut to the room
    for max_tokens, is_default, cut in ((None, False, False), (5, True, False), (5, False, True)):
        with pytest.raises(RequestError, match="the prompt has 32 input tokens .* leaves no room to generate") as e:
            resolve_max_tokens(max_tokens, 32, 32, is_default=is_default, cut=cut)
        assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


@pytest.mark.parametrize("is_default", [True, False])
def test_the_engine_cuts_any_max_tokens_to_the_context(is_default):
    # vLLM's engine takes a max_tokens past max_model_len and stops the request there ("length"), a default or not
    e = engine(context=32)
    out = run(e, [5] * 28, SamplingParams(max_tokens=100, ignore_eos=True), max_tokens_is_default=is_default)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    out = run(e, [5] * 10, SamplingParams(max_tokens=3, ignore_eos=True), max_tokens_is_default=is_default)
    assert len(out.outputs[0].token_ids) == 3  # a value that fits is kept
    with pytest.raises(RequestError, match="leaves no room to generate"):  # nothing makes room
        e.add_request(prompt_token_ids=[5] * 32, params=SamplingParams(max_tokens=9), max_tokens_is_default=is_default)
    # vLLM checks min_tokens before the length: it would run past max_model_len; kiln refuses, saying what fits
    with pytest.raises(RequestError, match="min_tokens = 6 is more than the 4 tokens the model context leaves") as err:
        e.add_request(prompt_token_ids=[5] * 28, params=SamplingParams(max_tokens=100, min_tokens=6),
                      max_tokens_is_default=is_default)
    assert err.value.param == "min_tokens" and not e.has_unfinished()
    assert ("(a default)" in str(err.value)) == is_default


def test_the_engine_names_its_own_max_model_len():
    e = engine(context=64, max_model_len=16)
    assert e.max_tokens_for(10, None) == 6 and e.max_tokens_for(10, 9, is_default=True) == e.max_tokens_for(10, 9) == 6
    with pytest.raises(RequestError, match="exceeds the engine's max_model_len of 16"):  # the server's rule
        e.max_tokens_for(10, 9, cut=False)
    with pytest.raises(RequestError, match=r"maximum context length is 16 tokens \(the engine's max_model_len\)"):
        e.add_request(prompt_token_ids=[5] * 16, params=SamplingParams(max_tokens=None))
