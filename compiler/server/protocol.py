"""OpenAI request models (pydantic) and the error JSON shape.

Fields map onto kiln's SamplingParams; ones the engine cannot honour (suffix, chat's echo) are refused with a 400
naming the field rather than silently ignored. Fields beyond kiln's own are sorted by kiln.server.fields: metadata is
accepted and ignored (each name logged once per server), fields that would change the output and that kiln cannot
honour are a 400 saying kiln does not support them, and anything else is an unknown field (a typo), refused with the
closest known one. logprobs (completions: 0 .. 20 top alternatives) and logprobs + top_logprobs (chat) map onto
SamplingParams.logprobs; presence / frequency penalties and logit_bias (OpenAI's: string token ids) and vLLM's
min_tokens onto the SamplingParams fields of those names. Completions' echo (the prompt before the text, and with
logprobs its tokens' logprobs before the output's; max_tokens 0: the prompt alone, as lm-evaluation-harness asks for
loglikelihoods) and vLLM's prompt_logprobs map onto SamplingParams.prompt_logprobs. Chat's vLLM fields
add_generation_prompt and continue_final_message go to the chat template (ChatTemplate.render), and so do the tools
(with tool_choice "none": kiln parses no tool calls).

The models live in request_base.py (the shared bases), completion_request.py and chat_request.py, all importable
from here; /tokenize's and /detokenize's are here.
"""

from __future__ import annotations

from typing import ClassVar

from kiln.server.chat_request import ChatCompletionRequest, ChatMessage, _Conversation, sort_message_fields  # noqa: F401
from kiln.server.completion_request import CompletionRequest
from kiln.server.errors import APIError, error_body, request_error
from kiln.server.fields import TOKENIZE_TOOL_CHOICE
from kiln.server.request_base import MAX_N, MAX_PROMPTS, StreamOptions, _Body, ignored_sink  # noqa: F401

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "error_body", "request_error"]


# vLLM's /tokenize and /detokenize (kiln.server.app).


class TokenizeCompletionRequest(_Body):
    prompt: str
    add_special_tokens: bool = True  # the special tokens the tokenizer adds (Llama's BOS), as vLLM's default
    return_token_strs: bool = False  # also each token's string in the vocabulary (token_strs)


class TokenizeChatRequest(_Conversation):
    # tools render as chat completions renders them (vLLM's /tokenize takes tools and no tool_choice); tool_choice
    # "none" is taken too, so that a chat request's fields can be sent as they are
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {"tool_choice": TOKENIZE_TOOL_CHOICE}

    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
