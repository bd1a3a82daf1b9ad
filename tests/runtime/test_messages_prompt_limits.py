"""A prompt that alone fills the context is refused as such, whatever max_tokens is: lowering max_tokens cannot help,
so the message says to shorten the prompt only; prompt + max_tokens over it says how far to lower max_tokens."""

from __future__ import annotations

import pytest

from kiln.errors import RequestError
from kiln.runtime.prompt_limits import resolve_max_tokens
from kiln.runtime.request_checks import check_prompt


@pytest.mark.parametrize("prompt_len", [256, 403])
def test_a_prompt_over_the_context_with_max_tokens_given_says_shorten_the_prompt(prompt_len):
    with pytest.raises(RequestError) as e:
        resolve_max_tokens(4, prompt_len, 256)  # `kiln run` and the server check a max_tokens given (no cut)
    msg = str(e.value)
    assert msg == (f"the prompt has {prompt_len} input tokens and this model's maximum context length is 256 tokens "
                   "(the model context), which leaves no room to generate; shorten the prompt"), msg
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


def test_check_prompt_says_the_same():
    with pytest.raises(RequestError, match="the prompt has 70 input tokens .* leaves no room to generate; shorten the "
                                           "prompt$") as e:
        check_prompt([5] * 70, 8, vocab=100, limit=64)
    assert e.value.param == "prompt" and "max_tokens" not in str(e.value)


def test_prompt_plus_max_tokens_over_the_context_says_how_far_to_lower_it():
    with pytest.raises(RequestError, match=r"prompt of 30 tokens \+ max_tokens 100 = 130 exceeds the engine's "
                                           "max_model_len of 32; shorten the prompt or lower max_tokens to at most 2$"):
        resolve_max_tokens(100, 30, 32, limit_name="engine's max_model_len")
    with pytest.raises(RequestError, match=r"60 tokens \+ max_tokens 8 = 68 exceeds the model context of 64; shorten "
                                           "the prompt or lower max_tokens to at most 4$"):
        check_prompt([5] * 60, 8, vocab=100, limit=64)
