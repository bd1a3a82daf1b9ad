"""SamplingParams' allowed ranges say what is really allowed: top_k -1 is taken (vLLM's "off"), and a range open above
(temperature, repetition_penalty) refuses inf and nan, so it says "finite"."""

from __future__ import annotations

import math

import pytest

from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams


def _refusal(**kw) -> str:
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == next(iter(kw))
    return str(e.value)


def test_top_k_names_minus_one_as_allowed():
    SamplingParams(top_k=-1).validate()  # what the message promises
    assert _refusal(top_k=-3) == ("sampling parameter top_k = -3 is out of range; allowed: an integer top_k >= -1 "
                                  "(0 or -1 means off)")


@pytest.mark.parametrize("value", [math.inf, math.nan, -math.inf])
@pytest.mark.parametrize(("name", "allowed"), [("temperature", "a finite temperature >= 0 (0 means greedy)"),
                                               ("repetition_penalty", "a finite repetition_penalty > 0 (1 means off)")])
def test_a_range_open_above_says_finite(name, allowed, value):
    assert _refusal(**{name: value}) == f"sampling parameter {name} = {value!r} is out of range; allowed: {allowed}"


@pytest.mark.parametrize("name", ["top_p", "min_p", "presence_penalty", "frequency_penalty"])
def test_bounded_ranges_already_exclude_inf(name):
    # the other float parameters' ranges have both ends: inf is plainly outside them
    msg = _refusal(**{name: math.inf})
    assert f"{name} = inf is out of range; allowed: " in msg and "finite" not in msg
    assert f"<= {name} <=" in msg or f"< {name} <=" in msg, msg
