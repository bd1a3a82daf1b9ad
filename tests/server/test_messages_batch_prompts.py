"""A batch of prompts to /v1/completions: an error about one prompt names it ("prompt 1: ..."), as LLM.generate's do;
a single prompt's errors and a request-wide parameter's have no index."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

VOCAB = 512  # tiny-llama's
BASE = {"model": "tiny-llama", "max_tokens": 2, "temperature": 0}


def _error(url: str, body: dict | str) -> dict:
    if isinstance(body, str):  # raw JSON, for what json.dumps cannot write (1e309)
        r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url + "/v1/completions", json={**BASE, **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("n", [1, 2])
def test_an_id_out_of_the_vocabulary_names_its_prompt(url, n):
    err = _error(url, {"prompt": [[1, 2], [3, 9999]], "n": n})  # with n = 2, the fourth engine request: prompt 1
    assert err["message"].startswith(f"prompt 1: prompt_token_ids [9999] out of range for a vocabulary of {VOCAB}; "
                                     "allowed: "), err
    assert err["param"] == "prompt"


def test_a_single_prompt_has_no_index(url):
    err = _error(url, {"prompt": [3, 9999]})
    assert err["message"].startswith("prompt_token_ids [9999] out of range"), err


def test_a_prompt_too_long_for_its_max_tokens_names_its_prompt(url):
    err = _error(url, {"prompt": [[1, 2], [7] * 250], "max_tokens": 10})
    assert err["message"].startswith("prompt 1: prompt of 250 tokens + max_tokens 10 = 260 exceeds the model context "
                                     "of 256"), err
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")


def test_an_empty_prompt_in_a_batch_names_it(url):
    err = _error(url, {"prompt": [[1], [2], []]})
    assert err["message"].startswith("prompt 2: the prompt is empty"), err


def test_a_request_wide_parameter_names_no_prompt(url):
    # the same for every prompt: blaming prompt 0 would send the client looking in the wrong place
    err = _error(url, {"prompt": [[1, 2], [3, 4]], "stop_token_ids": [9999]})
    assert err["message"].startswith("stop_token_ids [9999] out of range for a vocabulary of 512"), err
    assert err["param"] == "stop_token_ids"


def test_an_infinite_temperature_is_refused_as_not_finite(url):
    err = _error(url, '{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "temperature": 1e309}')
    assert "temperature = inf is out of range; allowed: a finite temperature >= 0" in err["message"], err
    assert err["param"] == "temperature"


def test_a_min_tokens_over_what_a_prompt_leaves_names_that_prompt(url):
    # max_tokens null: each prompt's limit is the room it leaves, so the error is about one prompt
    err = _error(url, {"prompt": [[1, 2], [7] * 250], "max_tokens": None, "min_tokens": 10})
    assert err["message"].startswith("prompt 1: min_tokens = 10 is more than the 6 tokens"), err
    assert err["param"] == "min_tokens"
    # a limit the client gave is the same for every prompt: no index
    err = _error(url, {"prompt": [[1, 2], [3, 4]], "max_tokens": 3, "min_tokens": 5})
    assert err["message"].startswith("min_tokens = 5 is more than max_tokens = 3"), err
