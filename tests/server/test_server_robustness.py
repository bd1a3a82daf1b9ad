"""What a tester of `kiln serve` found: the model's own chat template,
admission that counts each request once, a failed request reported as a failure, OpenAI's nullable fields,
strict types, tool messages, /v1/models/{id}, raw bytes of partial-character tokens, tokenization off the event
loop, a port in use, and `kiln bench serve` against a keyed server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import pytest

from kiln.chat_template import ChatTemplate
from kiln.runtime.request import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.server.protocol import APIError
from kiln.server.streaming import Choices, sse_stream
from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def url(llm):
    llm.tokenizer.chat_template = ChatTemplate(
        "{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %}:{{ m.tool_call_id }}{% endif %}]"
        "{{ m.content }}{% endfor %}>", origin="the test's")
    try:
        with serve_llm(llm, engine=llm.engine) as u:
            yield u
    finally:
        del llm.tokenizer.chat_template


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_chat_uses_the_tokenizers_own_template(url, llm):
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("[user]Hi!>"))


def test_tool_messages_reach_the_template(url, llm):
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("[user]x[assistant][tool:c1]42>"))


def test_null_means_the_default_and_types_are_strict(url):
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "top_k": None, "seed": None,
             "presence_penalty": None, "frequency_penalty": None, "echo": None, "ignore_eos": None, "stop": None}
    r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                            "logprobs": None, "top_logprobs": None, "temperature": None})
    assert r.status_code == 200, r.text
    for field, value in (("max_tokens", True), ("temperature", "0.5"), ("n", 1.0), ("stream", 1)):
        r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0}).status_code == 200


def test_models_by_id(url):
    card = httpx.get(f"{url}/v1/models/tiny-llama", timeout=30).json()
    assert card["id"] == "tiny-llama" and abs(card["created"] - time.time()) < 3600  # when the server started
    r = httpx.get(f"{url}/v1/models/gpt-4", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_partial_character_tokens_carry_their_raw_bytes(url, llm):
    """tiny-llama's byte tokenizer: ids 128..255 are parts of UTF-8 characters; each decodes alone to U+FFFD but
    its bytes are the id itself, so a client can rejoin them."""
    body = {"messages": [{"role": "user", "content": "é"}], "max_tokens": 24, "temperature": 1, "seed": 7,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    content = _post(url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    entries = [e for c in content for e in (c, *c["top_logprobs"])]
    partial = [e for e in entries if e["token"] == "\ufffd"]
    assert partial, "no partial-character token sampled: pick another seed"
    assert all(len(e["bytes"]) == 1 and e["bytes"][0] >= 128 for e in partial)
    assert len({e["bytes"][0] for e in partial}) > 1  # different tokens, different bytes
    whole = [e for e in entries if e["token"] != "\ufffd"]
    assert all(e["bytes"] == list(e["token"].encode()) for e in whole)


def test_tokenization_runs_off_the_event_loop(url, llm, monkeypatch):
    threads = []
    encode = llm.tokenizer.encode

    def spy(text: str, **kw) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", spy)
    assert _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert threads and "kiln-server" not in threads  # the server thread runs the event loop


def _output(rid: str, finish: str | None, error: str | None = None) -> RequestOutput:
    comp = CompletionOutput(0, [5], "x", finish, delta_token_ids=[5], delta_text="x")
    return RequestOutput(rid, None, [1], [comp], finish is not None, RequestMetrics(arrival_time=0.0), error)


def test_a_failed_request_is_an_error_not_a_stop():
    c = Choices("cmpl-1", "text_completion", "m", ["r"], 1)
    with pytest.raises(APIError, match="failed while generating: NaN logits") as e:
        c.update(_output("r", "error", "NaN logits"))
    assert e.value.status == 500

    async def stream() -> list[str]:
        sink: asyncio.Queue = asyncio.Queue()
        sink.put_nowait(_output("r", None))
        sink.put_nowait(_output("r", "error", "NaN logits"))
        return [e async for e in sse_stream(sink, Choices("cmpl-2", "text_completion", "m", ["r"], 1), False)]

    events = asyncio.run(stream())
    assert '"finish_reason":null' in events[0] and "NaN logits" in events[1] and events[-1] == "data: [DONE]\n\n"
    assert not any('"finish_reason":"stop"' in e for e in events)


def test_admission_counts_each_request_once(llm):
    """Between the engine thread applying an add (and publishing its stats) and the add's future resolving, the
    request is in the engine's waiting queue: it must not also count as pending."""
    from kiln.runtime.engine import Engine
    from kiln.server.engine_loop import EngineLoop
    from kiln.server.metrics import ServerMetrics

    engine = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=32, max_num_seqs=1)
    loop = EngineLoop(engine, ServerMetrics("tiny-llama"))

    async def run() -> list[int]:
        loop._loop = asyncio.get_running_loop()
        seen = [loop.num_waiting]
        adds = [asyncio.create_task(loop.add([(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2))], asyncio.Queue()))
                for i in range(3)]
        await asyncio.sleep(0)  # the three adds are posted
        seen.append(loop.num_waiting)
        loop._apply(block=False)  # what the engine thread does: apply, publish; the futures resolve later
        seen.append(loop.num_waiting)
        await asyncio.gather(*adds)
        seen.append(loop.num_waiting)
        return seen

    assert asyncio.run(run()) == [0, 3, 3, 3]


def test_a_port_in_use_fails_before_loading_with_the_fix():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "kiln", "serve", "tiny-llama", "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in res.stderr and "--port" in res.stderr
    assert "serving" not in res.stderr


def test_bench_serve_against_a_keyed_server_asks_for_the_key(llm):
    with serve_llm(llm, engine=llm.engine, api_key="sk-x") as u:
        res = subprocess.run([sys.executable, "-m", "kiln", "bench", "serve", "--base-url", u, "--num-requests",
                              "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "wants an API key" in res.stderr and "--api-key" in res.stderr


def test_completion_text_offsets_stay_on_the_text_past_partial_characters(url):
    body = {"prompt": "é", "max_tokens": 24, "temperature": 1, "seed": 7, "logprobs": 1, "ignore_eos": True}
    choice = _post(url, "/v1/completions", body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert "\ufffd" in lp["tokens"], "no partial-character token sampled: pick another seed"
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for tok, off in zip(lp["tokens"], offsets, strict=True):
        if tok != "\ufffd":
            assert text[off: off + len(tok)] == tok, (tok, off, text)


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(url, llm):
    from kiln import SamplingParams

    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    stop = greedy.token_ids[3]
    cut = greedy.token_ids.index(stop) + 1
    for include in (False, True):
        r = _post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                           "stop_token_ids": [stop],
                                           "return_token_ids": True, "include_stop_str_in_output": include})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["token_ids"] == greedy.token_ids[:cut]
        assert choice["text"] == llm.tokenizer.decode(greedy.token_ids[: cut if include else cut - 1])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_the_error_whatever_else_the_body_gets_wrong(url, route):
    """vLLM checks the model before the fields: a client that names the wrong model learns that first."""
    for bad in ({"max_tokens": "bad"}, {"temperature": -1}, {"not_a_field": 1}):
        body = {"model": "nope", "prompt": "x", "messages": [{"role": "user", "content": "x"}], **bad}
        r = _post(url, route, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (bad, r.text)
