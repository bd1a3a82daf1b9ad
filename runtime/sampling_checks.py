"""The value helpers behind SamplingParams' checks: _plain and _int_tuple (numpy / torch scalars and sequences as
plain Python values), _finite and _is_int, and _wrong_type (the type a bad parameter must have, for validate()).
"""

from __future__ import annotations

import math
import operator

_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("top_k", "min_tokens", "n")
_OPTIONAL_INTS = ("seed", "logprobs", "max_tokens", "prompt_logprobs", "truncate_prompt_tokens")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def _wrong_type(name: str, value: object) -> tuple[str, object] | None:
    """(the type `name` must have, the offending value or item) when `value` has another type; None when its type
    is right (then only its range is wrong)."""
    if name in _NUMBERS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else ("a number", value)
    if name in _INTS:
        return None if _is_int(value) else ("an integer", value)
    if name in _OPTIONAL_INTS:
        return None if value is None or _is_int(value) else ("an integer or None", value)
    if name in _BOOLS:
        return None if isinstance(value, bool) else ("a bool (True or False)", value)
    if name == "speculate":
        return None if value is None or isinstance(value, bool) else ("a bool or None", value)
    if name == "output_kind":
        return None if isinstance(value, str) else ("a string", value)
    if name == "logit_bias":
        if not isinstance(value, dict):
            return "a dict {token id: bias} or None", value
        bad_keys = [k for k in value if not _is_int(k)]
        if bad_keys:
            return "a dict whose keys are token ids (integers)", bad_keys[0]
        bad = [v for v in value.values() if isinstance(v, bool) or not isinstance(v, (int, float))]
        return ("a dict whose values are numbers", bad[0]) if bad else None
    if name == "allowed_token_ids" and isinstance(value, tuple) and not value:
        return None  # empty: a range error (no token could be sampled), not a type error
    if name in ("stop_token_ids", "stop", "allowed_token_ids"):
        kind = "strings" if name == "stop" else "token ids (integers)"
        if not isinstance(value, tuple):
            return kind, value
        bad = [t for t in value if not (isinstance(t, str) if name == "stop" else _is_int(t))]
        return (kind, bad[0]) if bad else None
    return None


def _plain(value: object) -> object:
    """A numpy scalar (np.float64, a float subclass, included) or 0-d tensor as the Python value it holds; anything
    else unchanged (validate() names it)."""
    if type(value) not in (bool, int, float, str) and value is not None and hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return value


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_tuple(value: object) -> object:
    """One token id or a sequence of them (lists, tuples, numpy arrays, tensors) as a tuple of ints; any other
    value unchanged, for validate() to name."""
    if isinstance(value, (str, bytes, bool)):
        return value
    try:
        return (operator.index(value),)
    except TypeError:
        pass
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        return value
    out = []
    for t in items:
        try:
            out.append(t if isinstance(t, bool) else operator.index(t))
        except TypeError:
            out.append(t)
    return tuple(out)
