"""The server against vLLM's OpenAI server on the points an audit found different: completions' max_tokens is 16 when
omitted (vLLM's CompletionRequest default, checked as if sent, the model's default max_tokens unused) and no limit
but the context when sent as null (the model's default, cut to the context); a max_tokens the client sends past the
context is a 400 (vLLM's server refuses it, though the engine would cut it); and a failure reading from the client
is logged with its traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")

CTX = 256  # tiny-llama's context
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(llm):
    """Two servers on the model: without a generation default, and with one of 20 tokens."""
    with serve_llm(llm) as a, serve_llm(llm, generation_defaults={"max_tokens": 20}) as b:
        yield a, b


def completion_tokens(url: str, body: dict) -> int:
    r = httpx.post(url + "/v1/completions", json={"prompt": [7] * 10, **GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def test_completions_max_tokens_omitted_is_16_and_null_is_unlimited(servers):
    plain, with_default = servers
    assert completion_tokens(plain, {}) == completion_tokens(with_default, {}) == 16  # the model's default unused
    assert completion_tokens(with_default, {"max_tokens": None}) == 20  # null: the model's default ...
    assert completion_tokens(plain, {"max_tokens": None}) == CTX - 10  # ... or the rest of the context
    assert completion_tokens(with_default, {"max_tokens": 3}) == 3  # a value sent wins


def test_min_tokens_over_completions_default_names_it(servers):
    plain, _ = servers
    r = httpx.post(plain + "/v1/completions", json={"prompt": [7] * 10, "min_tokens": 20}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", r.text
    assert "min_tokens = 20 is more than max_tokens = 16 (the default; set max_tokens)" in err["message"]
    r = httpx.post(
        plain + "/v1/completions", json={"prompt": [7] * (CTX - 10), "min_tokens": 20, "max_tokens": None}, timeout=120
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", r.text
    assert "the 10 tokens the context leaves after the prompt (max_tokens null)" in err["message"]


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens")]
)
def test_a_max_tokens_past_the_context_is_refused_not_cut(servers, path, field):
    plain, _ = servers
    body = {"prompt": [7] * 10} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(plain + path, json={**body, field: CTX, **GREEDY}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (field, "context_length_exceeded"), r.text
    assert f"exceeds the model context of {CTX}; shorten the prompt or lower max_tokens" in err["message"]


def test_a_failure_reading_from_the_client_is_logged_with_its_traceback(caplog):
    from kiln.server.generate import _GONE, _watch_disconnect

    class Broken:
        async def receive(self) -> dict:
            raise RuntimeError("the transport broke")

    sink: asyncio.Queue = asyncio.Queue()
    with caplog.at_level(logging.WARNING, logger="kiln.server"):
        asyncio.run(_watch_disconnect(Broken(), sink))
    assert sink.get_nowait() is _GONE  # the request is still aborted, as before
    [rec] = [r for r in caplog.records if "reading from the client failed" in r.getMessage()]
    assert rec.exc_info is not None and rec.exc_info[0] is RuntimeError
