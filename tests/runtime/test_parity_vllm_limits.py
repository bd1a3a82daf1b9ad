"""kiln's LLM against vLLM's on the points an audit found different: a max_tokens past the context stops at
max_model_len with finish_reason "length" (vLLM's engine checks only that the prompt leaves room, and its check_stop
ends the request at max_model_len), so one long prompt does not fail a batch; with n > 1 num_cached_tokens counts the
prompt's cached tokens once (vLLM's output of a request with n > 1 is its last child's, with that child's count); and
a token the detokenizer cannot decode alone is logged with its traceback rather than dropped silently."""

from __future__ import annotations

import logging

import pytest

from kiln.errors import RequestError
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.sampling_params import SamplingParams

CTX = 64


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False, max_model_len=CTX)


def test_a_max_tokens_past_the_context_stops_there_and_fails_no_batch(llm):
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    short, long = [5] * 10, [7] * 50  # 10 + 40 fits; 50 + 40 does not
    outs = llm.generate(prompt_token_ids=[short, long], sampling_params=params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [40, CTX - 50]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    # the same as asking for exactly the room: the context is a limit, not a change of the request
    exact = llm.generate(
        prompt_token_ids=long,
        sampling_params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=CTX - 50),
        use_tqdm=False,
    )
    assert exact[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_a_prompt_that_leaves_no_room_is_still_refused(llm):
    # vLLM refuses it too ("plus the number of requested output tokens (at least 1)")
    with pytest.raises(RequestError, match=f"the prompt has {CTX} input tokens .* leaves no room to generate"):
        llm.generate(prompt_token_ids=[5] * CTX, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)


def test_min_tokens_past_the_room_is_refused_naming_it(llm):
    # vLLM checks min_tokens before the length and would run past max_model_len; kiln says what fits instead
    with pytest.raises(RequestError, match="min_tokens = 20 is more than the 14 tokens") as e:
        llm.generate(
            prompt_token_ids=[5] * 50, sampling_params=SamplingParams(max_tokens=40, min_tokens=20), use_tqdm=False
        )
    assert e.value.param == "min_tokens"


def test_num_cached_tokens_of_n_choices_counts_the_prompt_once(llm):
    prompt = list(range(10, 45))  # 35 tokens: 2 full blocks of 16 cached by the first call
    llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate(
        prompt_token_ids=prompt,
        use_tqdm=False,
        sampling_params=SamplingParams(n=3, seed=1, max_tokens=2, ignore_eos=True),
    )[0]
    assert len(out.outputs) == 3
    assert out.num_cached_tokens == out.metrics.num_cached_tokens == 32  # not 3 x 32: it counts prompt tokens


class _Slow:
    """A tokenizer that cannot decode id 7 alone (a slow tokenizer past its vocabulary does so)."""

    def decode(self, ids: list[int]) -> str:
        if 7 in ids:
            raise IndexError("piece id is out of range")
        return "".join(chr(97 + t % 26) for t in ids)


def test_a_token_the_tokenizer_cannot_decode_is_logged_with_its_traceback(caplog):
    det = Detokenizer(_Slow())
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        assert det.token_str(7) is None and det.token_str(7) is None  # the request goes on, as before
        assert det.token_str(1) == "b"
    said = [r for r in caplog.records if "decoding token id 7 alone failed" in r.getMessage()]
    assert len(said) == 1  # once per tokenizer type and exception type: a vocabulary's worth would flood the log
    assert said[0].exc_info is not None and said[0].exc_info[0] is IndexError
    assert "IndexError: piece id is out of range" in said[0].getMessage()
