"""Request checks the tester found loose: a wrong type named as a type, stop ids outside the vocabulary."""

from __future__ import annotations

import pytest

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate

V = 97


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"temperature": "0.5"}, "temperature = '0.5' must be a number, not str"),
        ({"top_p": None}, "top_p = None must be a number, not NoneType"),
        ({"min_p": [0.1]}, "min_p = [0.1] must be a number, not list"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty = '1.1' must be a number, not str"),
        ({"top_k": 2.5}, "top_k = 2.5 must be an integer, not float"),
        ({"max_tokens": "8"}, "max_tokens = '8' must be an integer or None, not str"),
        ({"max_tokens": True}, "max_tokens = True must be an integer or None, not bool"),
        ({"seed": 1.0}, "seed = 1.0 must be an integer or None, not float"),
        ({"logprobs": "2"}, "logprobs = '2' must be an integer or None, not str"),
        ({"ignore_eos": "yes"}, "ignore_eos = 'yes' must be a bool (True or False), not str"),
        ({"speculate": 1}, "speculate = 1 must be a bool or None, not int"),
        ({"output_kind": None}, "output_kind = None must be a string, not NoneType"),
        ({"stop": [1]}, "stop = (1,) must be strings, not int 1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids = ('a',) must be token ids (integers), not str 'a'"),
    ],
)
def test_a_wrong_type_is_named_as_a_type_not_a_range(fields, needle):
    with pytest.raises(RequestError) as err:
        SamplingParams(**fields).validate()
    msg = str(err.value)
    assert needle in msg and "out of range" not in msg and "allowed:" in msg


@pytest.mark.parametrize("fields", [{"temperature": -0.5}, {"top_k": -2}, {"stop": ("",)}, {"seed": 2**64}])
def test_a_right_type_out_of_range_still_says_out_of_range(fields):
    with pytest.raises(RequestError, match="is out of range; allowed"):
        SamplingParams(**fields).validate()


def _engine() -> Engine:
    return Engine(FakeStepModel(V), None, fake_config(64), block_size=4)


@pytest.mark.parametrize("stop", [[V], [5, 99999], V + 3])
def test_stop_token_ids_outside_the_vocabulary_are_refused(stop):
    e = _engine()
    good = e.add_request(prompt_token_ids=[5, 6], params=SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RequestError) as err:
        e.add_request(prompt_token_ids=[1, 2], params=SamplingParams(stop_token_ids=stop))
    msg = str(err.value)
    assert "stop_token_ids" in msg and f"vocabulary of {V}" in msg and f"0 .. {V - 1}" in msg
    done = {o.request_id: o.outputs[0].token_ids for o in e.run()}  # the engine keeps serving the others
    assert done == {good: fake_generate([5, 6], 3, V)}


def test_the_last_vocabulary_id_is_a_valid_stop_token():
    e = _engine()
    e.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[V - 1]))
    assert len(e.run()) == 1
