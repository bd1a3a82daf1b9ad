"""A second tester's findings: a non-streaming client that disconnects is aborted through the real ASGI path (with
and without --api-key), max_completion_tokens wins over max_tokens, seeds wrap at 2**64 for n > 1, errors name
the right param, a chat prompt that fills the context is refused as vLLM does, and include_usage streams carry
"usage": null on every chunk but the last."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.support.served_llm import llm_engine, serve_llm

httpx = pytest.importorskip("httpx")

MAX_LEN = 256  # tiny-llama's context


@pytest.fixture(scope="module")
def url(llm):
    with serve_llm(llm, engine=llm.engine) as u:
        yield u


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{model_name="tiny-llama"\}} (\S+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("api_key", [None, "sk-gone"])
def test_a_non_streaming_client_that_disconnects_is_aborted(llm, api_key):
    """A raw socket sends a long non-streaming completion and goes away: the request must be aborted (counted,
    its KV blocks freed) long before it could have finished."""
    # >= 20 ms a step: 230 tokens take >= 4.6 s, so finishing is not mistaken for an abort
    eng = llm_engine(llm, step_s=0.02)
    with serve_llm(llm, engine=eng, api_key=api_key) as u:
        host, port = u.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 230, "ignore_eos": True}).encode()
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(head + body)
            deadline = time.monotonic() + 30
            while _metric(u, "kiln_generation_tokens_total") < 5:  # it runs
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
            assert _metric(u, "kiln_kv_blocks_used") > 0
            s.shutdown(socket.SHUT_RDWR)
        left = time.monotonic()
        while _metric(u, "kiln_requests_aborted_total") < 1:
            assert time.monotonic() - left < 3, "the request was not aborted within 3 s of its client leaving"
            time.sleep(0.05)
        time.sleep(0.1)  # the abort and the stats published with it
        assert _metric(u, "kiln_kv_blocks_used") == 0 and _metric(u, "kiln_num_requests_running") == 0
        assert _metric(u, "kiln_generation_tokens_total") < 230
    assert not eng.block_manager.tables


def test_collect_returns_when_the_disconnect_message_comes_while_outputs_flow():
    """A decoding request outputs every step, so the sink is never quiet: the disconnect must still end it."""
    import asyncio

    from kiln.server.app import _collect

    class Leaves:  # the ASGI receive of a request whose body was read: the next message is the disconnect
        async def receive(self) -> dict:
            await asyncio.sleep(0.3)
            return {"type": "http.disconnect"}

    class Endless:
        done = False
        updates = 0

        def update(self, item) -> None:
            self.updates += 1

    async def run() -> tuple[float, int]:
        sink: asyncio.Queue = asyncio.Queue()

        async def feed() -> None:
            while True:
                sink.put_nowait(object())
                await asyncio.sleep(0.005)

        feeder = asyncio.create_task(feed())
        choices = Endless()
        t0 = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(_collect(Leaves(), sink, choices), timeout=5)
        finally:
            feeder.cancel()
        return asyncio.get_running_loop().time() - t0, choices.updates

    elapsed, updates = asyncio.run(run())
    assert 0.25 < elapsed < 1.5 and updates > 10  # outputs were taken until the client left, then it stopped


def test_a_failing_receive_ends_the_request_and_says_so(caplog):
    """The watcher's own failure (receive raising: the connection is broken) is logged and ends the request, rather
    than dying unseen and leaving the request generating for no one."""
    import asyncio

    from kiln.server.app import _collect

    class Broken:
        async def receive(self) -> dict:
            await asyncio.sleep(0.05)
            raise OSError("connection reset")

    class Waiting:
        done = False

    async def run() -> None:
        await asyncio.wait_for(_collect(Broken(), asyncio.Queue(), Waiting()), timeout=5)

    with caplog.at_level("WARNING", logger="kiln.server"):
        asyncio.run(run())
    assert "reading from the client failed (OSError: connection reset)" in caplog.text


def test_max_completion_tokens_wins_over_max_tokens(url):
    msgs = [{"role": "user", "content": "Hi"}]
    for max_tokens, max_completion_tokens in ((6, 2), (2, 6)):
        r = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": max_tokens, "ignore_eos": True,
                                                "max_completion_tokens": max_completion_tokens})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_completion_tokens


def test_the_largest_seed_wraps_to_0_for_the_next_choice(url):
    def ids(seed: int, n: int) -> list[list[int]]:
        r = _post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 1.0, "seed": seed,
                                           "n": n, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in r.json()["choices"]]

    top = 2**64 - 1
    both = ids(top, 2)
    assert both == [ids(top, 1)[0], ids(0, 1)[0]] and both[0] != both[1]
    r = _post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 2, "seed": 2**64, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"  # out of range is still refused


def test_errors_name_the_right_param(url):
    r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    chat = {"messages": [{"role": "user", "content": "y" * (MAX_LEN + 10)}], "max_tokens": 2}
    r = _post(url, "/v1/chat/completions", chat)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and err["code"] == "context_length_exceeded", r.text
    assert "shorten the messages" in err["message"]
    long = {"messages": [{"role": "user", "content": "y" * 100}]}
    r = _post(url, "/v1/chat/completions", {**long, "max_tokens": 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"  # the engine's RequestError.code
    r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = _post(url, "/v1/chat/completions", {**long, "max_completion_tokens": 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


def _filling(llm, tokens: int) -> list[dict]:
    """Chat messages that the model's template renders to exactly `tokens` tokens (tiny-llama: a byte each)."""
    from kiln.chat_template import chat_template_of

    template = chat_template_of(llm.tokenizer)

    def size(content: str) -> int:
        return len(llm.tokenizer.encode(template.render([{"role": "user", "content": content}])))

    msgs = [{"role": "user", "content": "x" * (tokens - size(""))}]
    assert size(msgs[0]["content"]) == tokens
    return msgs


def test_a_chat_prompt_that_fills_the_context_is_refused_naming_the_messages(url, llm):
    r = _post(url, "/v1/chat/completions", {"messages": _filling(llm, MAX_LEN)})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and err["code"] == "context_length_exceeded", r.text
    assert f"maximum context length is {MAX_LEN} tokens" in err["message"]
    assert f"{MAX_LEN} input tokens" in err["message"] and "leaves no room to generate" in err["message"]
    r = _post(url, "/v1/chat/completions", {"messages": _filling(llm, MAX_LEN - 1), "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text  # one token of room


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_puts_usage_null_on_every_chunk_but_the_last(url, path):
    body = {"max_tokens": 5, "ignore_eos": True, "stream": True, "return_token_ids": True}  # a chunk a token
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}

    def events(extra: dict) -> list[dict]:
        with httpx.stream("POST", f"{url}{path}", json={**body, **extra}, timeout=60) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(ln) for ln in lines[:-1]]

    chunks = events({"stream_options": {"include_usage": True}})
    assert len(chunks) > 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in c for c in events({}))  # not asked: no usage key at all, as in OpenAI


def test_a_request_can_opt_out_of_speculation(llm):
    """`speculate: false` (kiln's extension, SamplingParams.speculate) keeps one request out of speculative
    decoding on a server that speculates: no draft tokens proposed for it, the same tokens either way."""
    from kiln import LLM

    spec = LLM("tiny-llama", device="cpu", seed=0, use_kernels=False, speculation="ngram(n = 2, k = 3)")
    eng = spec.engine
    body = {"prompt": [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with serve_llm(spec, engine=eng) as u:
        off = _post(u, "/v1/completions", {**body, "speculate": False})
        assert off.status_code == 200, off.text
        assert eng.stats.spec_proposed == 0
        on = _post(u, "/v1/completions", body)
        assert on.status_code == 200 and eng.stats.spec_proposed > 0
        assert off.json()["choices"][0]["token_ids"] == on.json()["choices"][0]["token_ids"]
        bad = _post(u, "/v1/completions", {**body, "speculate": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculate", bad.text
