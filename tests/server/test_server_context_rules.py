"""The server's share of the context rules (kiln.runtime.prompt_limits, which the engine applies for every caller):
a model's default max_tokens (generation_config.json's max_new_tokens) is cut to what the context leaves after the
prompt, as vLLM's get_max_tokens, while a max_tokens the client sends is checked (vLLM's server refuses it, where its
engine, and so kiln's LLM, would cut it); completions' max_tokens is 16 when omitted, as in vLLM (the model's default
applies to an explicit null); a prompt that leaves no room, or a truncate_prompt_tokens over max_model_len, is a 400
naming the field the client sent (chat: messages)."""

from __future__ import annotations

import pytest

from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")

CTX = 256  # tiny-llama's context
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(llm):
    # a default far past the context: every prompt would be refused if the default were checked as if sent
    with serve_llm(llm, generation_defaults={"max_tokens": 100000}) as u:
        yield u


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def messages_of(url: str, tokens: int) -> list[dict]:
    """A conversation the chat template renders to exactly `tokens` tokens (tiny-llama: a byte a token)."""
    def count(text: str) -> int:
        return post(url, "/tokenize", {"messages": [{"role": "user", "content": text}]}).json()["count"]

    msgs = [{"role": "user", "content": "x" * (tokens - count(""))}]
    assert count(msgs[0]["content"]) == tokens
    return msgs


def test_the_models_default_max_tokens_is_cut_to_the_context_left(url):
    r = post(url, "/v1/completions", {"prompt": [7] * (CTX - 6), "max_tokens": None, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(url, "/v1/chat/completions", {"messages": messages_of(url, CTX - 3), **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_completions_without_max_tokens_take_vllms_16_checked_as_if_sent(url):
    # vLLM's CompletionRequest.max_tokens defaults to 16, so the model's default never reaches its get_max_tokens
    r = post(url, "/v1/completions", {"prompt": [7] * 10, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    r = post(url, "/v1/completions", {"prompt": [7] * (CTX - 6), **GREEDY})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded"), r.text
    assert f"prompt of {CTX - 6} tokens + max_tokens 16 = {CTX + 10} exceeds the model context" in err["message"]


def test_a_max_tokens_the_client_sends_is_checked_not_cut(url):
    r = post(url, "/v1/completions", {"prompt": [7] * (CTX - 6), "max_tokens": 7, **GREEDY})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded"), r.text
    assert "exceeds the model context of 256" in err["message"]
    r = post(url, "/v1/chat/completions", {"messages": messages_of(url, CTX - 3), "max_completion_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


@pytest.mark.parametrize(("path", "param"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_prompt_that_fills_the_context_is_refused_under_a_default(url, path, param):
    body = {"prompt": [7] * CTX, "max_tokens": None} if param == "prompt" else {"messages": messages_of(url, CTX)}
    r = post(url, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (param, "context_length_exceeded"), r.text
    assert f"the prompt has {CTX} input tokens and this model's maximum context length is {CTX} tokens" in \
        err["message"] and "leaves no room to generate" in err["message"]


def test_min_tokens_over_the_cut_default_names_the_default(url):
    r = post(url, "/v1/chat/completions", {"messages": messages_of(url, CTX - 3), "min_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", r.text
    assert "min_tokens = 4 is more than the 3 tokens of the model's default max_tokens that fit the context" in \
        err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_truncation_past_max_model_len_is_refused_on_both_routes(url, path):
    body = {"prompt": [7] * 10} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(url, path, {**body, "max_tokens": 1, "truncate_prompt_tokens": CTX + 1})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("truncate_prompt_tokens", "invalid_value"), r.text
    assert f"truncate_prompt_tokens = {CTX + 1} is greater than max_model_len = {CTX}" in err["message"]
    r = post(url, path, {**body, "max_tokens": 1, "truncate_prompt_tokens": CTX - 1, **GREEDY})
    assert r.status_code == 200, r.text  # k up to max_model_len is taken
