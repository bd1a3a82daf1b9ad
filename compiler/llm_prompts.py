"""LLM.generate's prompts as vLLM's LLM takes them: _text_prompts (a str, a {"prompt": str} or
{"prompt_token_ids": [...]} dict, or a list of those) and _token_prompts (prompt_token_ids: one prompt or a batch),
each a list of prompts, with a RequestError naming what is not a prompt."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kiln.errors import RequestError


def _text_prompts(prompts: object) -> list[tuple[str, object]]:
    """("text", str) or ("ids", token ids) per prompt: a str, a vLLM-style {"prompt": str} or
    {"prompt_token_ids": [...]} dict, or a list of those (or of token-id lists)."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts, "prompts")]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a str, a {{'prompt': str}} or {{'prompt_token_ids': [...]}} dict, or "
                           f"a list of those, not {type(prompts).__name__} (token ids go in prompt_token_ids)")
    if prompts and all(isinstance(p, int) for p in prompts):
        raise RequestError("prompts is a list of ints: one prompt's token ids go in prompt_token_ids=[...] (or "
                           "prompts=[{'prompt_token_ids': [...]}]), as in vLLM; prompts takes text")
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _one_prompt(p: object, what: str) -> tuple[str, object]:
    if isinstance(p, str):
        return "text", p
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return "text", p["prompt"]
        if keys == {"prompt_token_ids"}:
            return "ids", p["prompt_token_ids"]
        raise RequestError(f"{what} is a dict with keys {sorted(map(str, keys))}; kiln takes {{'prompt': str}} or "
                           "{'prompt_token_ids': [ids]} (no multi-modal data or other fields)")
    if isinstance(p, (list, tuple)) or getattr(p, "ndim", None) == 1:  # one prompt's token ids (checked by the engine)
        return "ids", p
    raise RequestError(f"{what} is {type(p).__name__}, not a prompt: give a str, a {{'prompt': str}} / "
                       "{'prompt_token_ids': [...]} dict, or a list of token ids")


def _token_prompts(prompt_token_ids: object) -> list:
    """One prompt (a sequence of ints, a 1-D array or tensor) or several (a list of those, a 2-D array) as a
    list of prompts; the engine checks each one's ids."""
    ndim = getattr(prompt_token_ids, "ndim", None)
    if ndim is not None:  # numpy arrays and tensors
        if ndim == 1:
            return [prompt_token_ids]
        if ndim == 2:
            return list(prompt_token_ids)  # type: ignore[call-overload]
        raise RequestError(f"prompt_token_ids has {ndim} dimensions; give one prompt (1-D) or a batch (2-D)")
    if isinstance(prompt_token_ids, (str, bytes, dict)):
        raise RequestError(f"prompt_token_ids must be token ids (a list of ints, or a list of such lists), not "
                           f"{type(prompt_token_ids).__name__}; text goes in prompts")
    try:
        items = list(prompt_token_ids)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"prompt_token_ids must be a sequence of token ids or a list of them, not "
                           f"{type(prompt_token_ids).__name__}") from None
    if not items:
        raise RequestError("prompt_token_ids is empty; give at least one prompt of at least one token")
    try:
        operator.index(items[0])
        return [items]  # one prompt
    except TypeError:
        return items
