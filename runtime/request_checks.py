"""A request's prompt and sampling parameters checked against the model (its vocabulary and context), before the
request is made: check_prompt and check_params_for_model, which the engine and the reference path share. Plain
Python, no torch."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kiln.errors import RequestError
from kiln.runtime.prompt_limits import resolve_max_tokens
from kiln.runtime.sampling_params import SamplingParams


def check_params_for_model(params: SamplingParams, vocab: int) -> None:
    """RequestError for what validate() cannot see without the model: token ids past its vocabulary (a stop id
    could never fire; a logit_bias id would index past the logits), and n > 1 (one request is one sequence). The
    engine and the reference path share it."""
    if params.n != 1:
        raise RequestError(f"sampling parameter n = {params.n}: one request is one sequence; LLM.generate and the "
                           "server fan n out (SamplingParams.choices()), or add each choice yourself", param="n")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise RequestError(f"stop_token_ids {bad[:8]} out of range for a vocabulary of {vocab}; allowed: "
                           f"token ids 0 .. {vocab - 1}", param="stop_token_ids")
    bad = [t for t in (params.logit_bias or ()) if t >= vocab]
    if bad:
        raise RequestError(f"logit_bias token id {bad[0]} is out of range for a vocabulary of {vocab}; allowed: "
                           f"token ids 0 .. {vocab - 1}", param="logit_bias")
    bad = [t for t in (params.allowed_token_ids or ()) if t >= vocab]
    if bad:
        raise RequestError(f"allowed_token_ids {bad[:8]} out of range for a vocabulary of {vocab}; allowed: token ids "
                           f"0 .. {vocab - 1}", param="allowed_token_ids")


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, *, vocab: int, limit: int,
                 limit_name: str = "model context") -> list[int]:
    """The prompt as a list of ints, or a RequestError naming what is wrong: not integers, empty, an id outside
    the vocabulary, or prompt + max_tokens longer than `limit` (max_tokens None: the prompt must leave room for
    one token). The engine and the reference path share it."""
    if isinstance(prompt_token_ids, (str, bytes)):  # a str is a sequence too, of one-character strings
        raise RequestError(f"prompt_token_ids must be integer token ids, not {type(prompt_token_ids).__name__} "
                           f"{prompt_token_ids[:40]!r}; pass text as the prompt instead")
    if "bool" in str(getattr(prompt_token_ids, "dtype", "")):
        raise RequestError(f"prompt_token_ids is {_describe(prompt_token_ids)}: booleans, not token ids; give integers")
    try:
        items = list(prompt_token_ids)
        ids = [operator.index(t) for t in items]  # ints of any kind (numpy, 0-d tensors), not floats
    except TypeError:
        raise RequestError(f"prompt_token_ids must be a sequence of integer token ids (a list, a 1-D numpy array "
                           f"or 1-D integer tensor), not {_describe(prompt_token_ids)}{_culprit(prompt_token_ids)}"
                           ) from None
    if any(type(t) is bool for t in items):  # operator.index takes True as 1
        raise RequestError(f"prompt_token_ids holds a bool at position {[type(t) for t in items].index(bool)}, "
                           "not a token id; give integers")
    if not ids:
        raise RequestError("the prompt is empty; give at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt_token_ids {bad[:8]} out of range for a vocabulary of {vocab}; allowed: "
                           f"0 <= id < {vocab} (was the prompt encoded with this model's tokenizer?)", param="prompt")
    # a prompt that leaves no room, or prompt + max_tokens over the limit: refused there, saying which
    resolve_max_tokens(max_tokens, len(ids), limit, limit_name=limit_name)
    return ids


def _culprit(value: object) -> str:
    """Which item of a list is not a token id, as ' (position i is ...)', or ''."""
    if not isinstance(value, (list, tuple)):
        return ""
    for i, t in enumerate(value):
        try:
            operator.index(t)
        except TypeError:
            return f" (position {i} is {type(t).__name__} {t!r})"
    return ""


def _describe(value: object) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    return type(value).__name__
