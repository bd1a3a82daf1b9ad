"""The two rules that fit a request to the context, as vLLM applies them: how much of the prompt
SamplingParams.truncate_prompt_tokens keeps (prompt_keep, truncate_prompt), and how many tokens a request may
generate (resolve_max_tokens): unset, the rest of the context; a default the user never chose, cut to it; a value the
user gave, cut to it by the engine (vLLM's engine stops a request at max_model_len, finish_reason "length") but
refused by the server (vLLM's OpenAI server refuses prompt + max_tokens past max_model_len). The engine applies both
to every request it is given (LLM, `kiln run`, the server); the server also calls them before adding, since it needs
the truncated prompt (--max-prompt-tokens, echo, usage) and the number (its 400s) first. Plain Python, no torch: the
CLI uses them before anything loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.errors import RequestError


def prompt_keep(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens truncate_prompt_tokens keeps: None (all of them), k, or max_model_len for
    -1. A k over max_model_len is a RequestError, as vLLM's LLM and server refuse it (entrypoints'
    _validate_truncation_size); the value's own range (k >= 1 or -1) is SamplingParams.validate's."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise RequestError(f"sampling parameter truncate_prompt_tokens = {truncate_prompt_tokens} is greater than "
                           f"max_model_len = {max_model_len}; allowed: an integer 1 .. {max_model_len} (keep the "
                           "prompt's last k tokens) or -1 (its last max_model_len)", param="truncate_prompt_tokens")
    return truncate_prompt_tokens


def truncate_prompt(prompt_token_ids: Sequence[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> Sequence[int]:
    """The prompt as truncate_prompt_tokens keeps it (prompt_keep): its last k tokens, or all of it. Cutting a prompt
    already cut is a no-op, so the server's cut and the engine's agree. Anything but a plain sequence is returned as
    it is, for check_prompt to name."""
    keep = prompt_keep(truncate_prompt_tokens, max_model_len)
    if keep is None or isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__getitem__") \
            or not hasattr(prompt_token_ids, "__len__") or len(prompt_token_ids) <= keep:
        return prompt_token_ids
    return prompt_token_ids[len(prompt_token_ids) - keep :]


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int, *, is_default: bool = False,
                       cut: bool = False, limit_name: str = "model context") -> int:
    """How many tokens a request whose prompt has prompt_len tokens (after truncation) may generate, as vLLM's
    get_max_tokens: None, all that max_model_len leaves after the prompt; a default the user never chose (is_default:
    a checkpoint's max_new_tokens), cut to that, so a default never refuses a prompt; a value the user gave, cut to
    it too with `cut` (vLLM's engine, behind its LLM: the request stops at max_model_len with finish_reason "length"),
    else checked (vLLM's OpenAI server, and `kiln run`: more than the room is a RequestError naming both numbers).
    A prompt that leaves no room is a RequestError whatever max_tokens is (both code context_length_exceeded)."""
    room = max_model_len - prompt_len
    if room < 1:  # first: lowering max_tokens cannot help then
        raise RequestError(f"the prompt has {prompt_len} input tokens and this model's maximum context length is "
                           f"{max_model_len} tokens (the {limit_name}), which leaves no room to generate; shorten the "
                           "prompt", param="prompt", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room and not (is_default or cut):
        raise RequestError(f"prompt of {prompt_len} tokens + max_tokens {max_tokens} = {prompt_len + max_tokens} "
                           f"exceeds the {limit_name} of {max_model_len}; shorten the prompt or lower max_tokens "
                           f"to at most {room}", param="max_tokens", code="context_length_exceeded")
    return room if max_tokens is None else min(max_tokens, room)
