"""Request fields beyond the ones kiln computes with, sorted as vLLM's schemas sort them.

Three kinds, each decided per field from OpenAI's and vLLM's request schemas:
- metadata that changes nothing kiln computes (user, priority, store, metadata, service_tier, ...): accepted and
  dropped; the server logs each such name once (at info level), so an operator can see what clients send;
- fields kiln cannot honour and that would change the output (response_format other than text, guided_* /
  structured_outputs, beam search, ...): a 400 saying kiln does not support it, code unsupported_parameter, unless
  the value asks for nothing (functions [], function_call "none", response_format {"type": "text"}, ...); chat's
  tools and tool_choice are fields of the chat request (kiln.server.chat_request), whose check refuses a
  tool_choice other than "none" with the 400 that tool_choice_error makes;
- anything else: a typo, refused with the closest known field (difflib), as before, rather than silently ignored.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kiln.server.errors import APIError

# Metadata of the OpenAI / vLLM request schemas: accepted and ignored (name: why it changes nothing here).
IGNORED = {
    "user": "an end-user id for the provider's abuse monitoring",
    "priority": "kiln schedules requests first come, first served",
    "store": "OpenAI's stored completions",
    "metadata": "OpenAI's tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "OpenAI's prompt-cache routing hint",
    "safety_identifier": "OpenAI's end-user id",
    "prediction": "OpenAI's predicted output (a latency hint)",
    "session_id": "vLLM's session id (routing)",
    "cache_salt": "vLLM's prefix-cache salt",
    "kv_transfer_params": "vLLM's disaggregated-serving parameters",
    "ec_transfer_params": "vLLM's encoder-cache transfer parameters",
    "vllm_xargs": "vLLM's arguments for custom logits-processor plugins (kiln loads none)",
    "guided_decoding_backend": "vLLM's choice of structured-output backend (kiln takes no guided_* constraint)",
    "guided_whitespace_pattern": "vLLM's structured-output option (kiln takes no guided_* constraint)",
    "length_penalty": "vLLM's beam-search option (kiln does not beam search)",
    "stream_interval": "vLLM's tokens per streamed chunk (kiln streams each step's tokens)",
}
CHAT_IGNORED = {
    **IGNORED,
    "parallel_tool_calls": "kiln makes no tool calls",
    "include_reasoning": "vLLM's switch for a reasoning parser's output (kiln has none)",
    "media_io_kwargs": "vLLM's multimodal options (kiln's models read text only)",
    "mm_processor_kwargs": "vLLM's multimodal options (kiln's models read text only)",
}
# A chat message's fields that no chat template reads (vLLM drops them too): an id, and what the OpenAI SDK puts in
# an assistant message a client sends back as history.
MESSAGE_IGNORED = {
    "id": "a message id",
    "refusal": "an earlier reply's refusal text",
    "annotations": "an earlier reply's annotations",
    "audio": "an earlier reply's audio",
    "function_call": "OpenAI's deprecated function call of an earlier reply",
}


# vLLM request fields kiln does not take yet: unknown fields for now, and not taken for a typo of another field (no
# "did you mean").
NOT_YET = frozenset({"truncation_side"})


def ignored_reason(name: str) -> str:
    """Why a field named as sort_fields put it in the sink ("user", "messages[].id") changes nothing."""
    if name.startswith("messages[]."):
        return MESSAGE_IGNORED.get(name.removeprefix("messages[]."), "")
    return CHAT_IGNORED.get(name, "")


def _never(_value: Any) -> bool:
    return False


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected and type(value) is type(expected)


_STRUCTURED = "it cannot constrain its output to a schema, a regex, a grammar or a choice (no structured outputs)"
# What kiln does with tools: the chat template renders them (tool_choice "none", as vLLM renders them), and that is all.
_TOOLS = (
    "it makes no tool calls (it parses none out of the output, as vLLM does with --enable-auto-tool-choice and a "
    "--tool-call-parser, and has no structured outputs to force one)"
)
_TOOLS_FIX = 'send tool_choice "none" to have the chat template render the tools into the prompt (as vLLM renders them)'

# Fields kiln cannot honour that would change the output: (the value that asks for nothing, why, how to go on).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "response_format": (
        lambda v: isinstance(v, dict) and v.get("type") == "text",
        _STRUCTURED,
        'omit response_format, or send {"type": "text"}',
    ),
    "structured_outputs": (_never, _STRUCTURED, "omit structured_outputs"),
    "guided_json": (_never, _STRUCTURED, "omit guided_json"),
    "guided_regex": (_never, _STRUCTURED, "omit guided_regex"),
    "guided_choice": (_never, _STRUCTURED, "omit guided_choice"),
    "guided_grammar": (_never, _STRUCTURED, "omit guided_grammar"),
    "structural_tag": (_never, _STRUCTURED, "omit structural_tag"),
    "use_beam_search": (_is(False), "it has no beam search", "omit use_beam_search"),
    "logprob_token_ids": (_never, "it reports the top-k alternatives only", "use logprobs / top_logprobs"),
    "bad_words": (_is([]), "it has no banned-words filter", "omit bad_words (logit_bias bans single tokens)"),
    "watermarking": (_is(False), "it does not watermark", "omit watermarking"),
    "thinking_token_budget": (
        _is(-1),
        "it has no reasoning parser to count thinking tokens",
        "omit thinking_token_budget",
    ),
    "repetition_detection": (_never, "it has no repetition detector", "omit repetition_detection"),
}
COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED,
    "prompt_embeds": (_never, "it takes prompts as text or token ids", "send prompt instead"),
}
CHAT_UNSUPPORTED = {
    **UNSUPPORTED,
    # OpenAI's deprecated forms of tools / tool_choice
    "functions": (_is([]), _TOOLS, 'omit functions: send each as a tool ({"type": "function", "function": {...}}) '
                  'with tool_choice "none" to have the chat template render them into the prompt'),
    "function_call": (_is("none"), _TOOLS, 'omit function_call, or send "none"'),
    "documents": (_never, "its chat templates get no documents (RAG)", "put the documents in a message"),
    "modalities": (_is(["text"]), "its models write text only", 'omit modalities, or send ["text"]'),
    "audio": (_never, "its models write text only", "omit audio"),
    "web_search_options": (_never, "it has no web search", "omit web_search_options"),
}


# /tokenize's messages form renders tools whatever tool_choice says (vLLM's has no tool_choice field); it takes "none",
# so that a chat request's tool fields can be sent as they are, and refuses what the chat request refuses.
TOKENIZE_TOOL_CHOICE = (_is("none"), _TOOLS, _TOOLS_FIX + ", or omit tool_choice")


def tool_choice_error(value: Any, *, sent: bool, tools: bool) -> APIError | None:
    """The 400 for a chat request's tool_choice beside its tools (sent: tool_choice was in the body, null included;
    tools: a non-empty list of them was), or None when kiln takes the pair: tool_choice "none", or null (vLLM's null
    asks for no tool choice: its template renders the tools and nothing parses the output), or omitted without tools.
    Omitted with tools it is "auto" (OpenAI's and vLLM's default then), which vLLM refuses without
    --enable-auto-tool-choice and a tool parser; "required" and a named function need a parser or structured outputs
    too. kiln has neither."""
    if (sent and value is None) or value == "none" or (not sent and not tools):
        return None
    if not sent:
        return APIError(400, 'kiln does not support tools without tool_choice "none" (tool_choice defaults to "auto" '
                        f"when tools are given, as in OpenAI and vLLM): {_TOOLS}; {_TOOLS_FIX}, or omit tools",
                        param="tools", code="unsupported_parameter")
    if isinstance(value, dict):
        what = "tool_choice naming a function"
    elif value in ("auto", "required"):
        what = f"tool_choice {value!r}"
    else:
        return APIError(400, 'tool_choice must be "none", "auto", "required" or a named function ({"type": '
                        f'"function", "function": {{"name": ...}}}}), not {value!r}; kiln takes "none"',
                        param="tool_choice", code="invalid_value")
    return APIError(400, f"kiln does not support {what}: {_TOOLS}; {_TOOLS_FIX}, or omit tool_choice",
                    param="tool_choice", code="unsupported_parameter")


def sort_fields(
    data: dict,
    known: Iterable[str],
    *,
    ignored: Mapping[str, str] = {},
    unsupported: Mapping[str, tuple] = {},
    where: str = "",
    ignored_as: str = "",
    sink: set[str] | None = None,
) -> dict:
    """`data` without its ignored fields (their names, as `ignored_as` + name, go to `sink`) and without an
    unsupported field whose value asks for nothing; an unsupported field that asks for something is a 400 saying
    so, and an unknown one a 400 naming the closest known field. where: the dotted path before a field's name in
    errors ("messages.0.")."""
    known = set(known)
    out = {}
    for key, value in data.items():
        if key in known:
            out[key] = value
        elif key in ignored:
            if sink is not None:
                sink.add(ignored_as + key)
        elif key in unsupported:
            noop, why, fix = unsupported[key]
            if not noop(value):
                raise APIError(
                    400,
                    f"kiln does not support {key}{_detail(key, value)}: {why}; {fix}",
                    param=where + key,
                    code="unsupported_parameter",
                )
        else:
            raise unknown_field(where + key, key, [*known, *ignored, *unsupported])
    return out


def unknown_field(path: str, name: str, candidates: Iterable[str]) -> APIError:
    """The 400 for a field nobody defines: the closest known one when there is one (a typo), else how to go on."""
    close = []
    if isinstance(name, str) and name not in NOT_YET:
        close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.75)
    hint = (
        f"did you mean {close[0]!r}?"
        if close
        else "remove it (kiln refuses a field it does not know rather than ignore what may be a misspelt one; see "
        "the OpenAI API reference for the fields)"
    )
    return APIError(400, f"unknown field {path!r}; {hint}", param=path, code="unknown_field")


def _detail(key: str, value: Any) -> str:
    if key == "response_format" and isinstance(value, dict) and isinstance(value.get("type"), str):
        return f" of type {value['type']!r}"
    if key in ("tool_choice", "function_call") and isinstance(value, str):
        return f" {value!r}"
    return ""
