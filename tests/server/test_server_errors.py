"""Bad requests to `kiln serve`: each gets OpenAI's error shape, a status code and a message naming the problem,
and none of them disturbs a request being served meanwhile."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.support.served_llm import llm_engine, serve_llm

httpx = pytest.importorskip("httpx")

KEY = "sk-table"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, path, body (a dict, or raw bytes), headers, status, a piece of the message, param)
CASES = [
    ("no key", "/v1/completions", OK, {}, 401, "invalid or missing API key", None),
    ("wrong key", "/v1/completions", OK, {"Authorization": "Bearer sk-nope"}, 401, "Bearer <key>", None),
    ("key without Bearer", "/v1/models", None, {"Authorization": KEY}, 401, "API key", None),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-4"}, AUTH, 404, "'gpt-4' does not exist", "model"),
    ("bad JSON", "/v1/completions", b'{"prompt": "Hi",', AUTH, 400, "not valid JSON", None),
    ("not UTF-8", "/v1/completions", b"\xff\xfe{}", AUTH, 400, "not valid JSON", None),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, "valid dictionary", "body"),
    ("oversized body", "/v1/completions", {**OK, "prompt": "x" * 5000}, AUTH, 413, "limit of 4096 bytes", None),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -5}, AUTH, 400,
     "sampling parameter max_tokens = -5 is out of range", "max_tokens"),
    ("max_tokens 0 without echo", "/v1/completions", {**OK, "max_tokens": 0}, AUTH, 400,
     "allowed only with echo: true", "max_tokens"),
    ("chat max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, AUTH, 400,
     "max_tokens = 0 is out of range; allowed: an integer max_tokens >= 1", "max_tokens"),
    ("chat max_completion_tokens 0", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, AUTH, 400,
     "max_tokens = 0 is out of range", "max_completion_tokens"),
    ("chat max_tokens 0 under max_completion_tokens", "/v1/chat/completions",
     {**CHAT, "max_tokens": 0, "max_completion_tokens": 3}, AUTH, 400, "max_tokens = 0 is out of range", "max_tokens"),
    ("prompt_logprobs -1 streamed", "/v1/completions", {**OK, "prompt_logprobs": -1, "stream": True}, AUTH, 400,
     "prompt_logprobs = -1 is out of range", "prompt_logprobs"),
    ("min_tokens over echo's max_tokens 0", "/v1/completions", {**OK, "max_tokens": 0, "echo": True, "min_tokens": 1},
     AUTH, 400, "min_tokens = 1 is more than max_tokens = 0", "min_tokens"),
    ("max_tokens a word", "/v1/completions", {**OK, "max_tokens": "ten"}, AUTH, 400, "valid integer", "max_tokens"),
    ("negative temperature", "/v1/completions", {**OK, "temperature": -1}, AUTH, 400,
     "temperature = -1.0 is out of range; allowed: a finite temperature >= 0", "temperature"),
    ("top_p zero", "/v1/completions", {**OK, "top_p": 0}, AUTH, 400, "top_p = 0.0 is out of range; allowed: 0 < top_p",
     "top_p"),
    ("top_k under -1", "/v1/completions", {**OK, "top_k": -2}, AUTH, 400, "top_k = -2 is out of range", "top_k"),
    ("seed a float", "/v1/completions", {**OK, "seed": 1.5}, AUTH, 400, "valid integer", "seed"),
    ("stream a list", "/v1/completions", {**OK, "stream": [1]}, AUTH, 400, "valid boolean", "stream"),
    ("unknown field", "/v1/completions", {**OK, "foo": 1}, AUTH, 400, "unknown field 'foo'", "foo"),
    ("missing prompt", "/v1/completions", {"model": "tiny-llama"}, AUTH, 400, "Field required", "prompt"),
    ("prompt a number", "/v1/completions", {**OK, "prompt": 5}, AUTH, 400, "field 'prompt'", "prompt"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, AUTH, 400, "prompt is empty", "prompt"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, AUTH, 400, "prompt is empty; give text",
     "prompt"),
    ("empty token list in a batch", "/v1/completions", {**OK, "prompt": [[1], []]}, AUTH, 400,
     "the prompt is empty", "prompt"),
    ("suffix", "/v1/completions", {**OK, "suffix": "!"}, AUTH, 400, "suffix is not supported", "suffix"),
    ("prompt over the limit", "/v1/completions", {**OK, "prompt": "y" * 100}, AUTH, 400, "over the limit of 64",
     "prompt"),
    ("prompt + max_tokens over the context", "/v1/completions", {**OK, "prompt": "z" * 60, "max_tokens": 250}, AUTH,
     400, "exceeds the model context of 256", "max_tokens"),
    ("token id out of vocab", "/v1/completions", {**OK, "prompt": [1, 999]}, AUTH, 400, "out of range", "prompt"),
    ("n zero", "/v1/completions", {**OK, "n": 0}, AUTH, 400, "n = 0 is out of range; allowed: an integer n >= 1",
     "n"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, AUTH, 400, "allowed: non-empty strings", "stop"),
    ("logprobs over 20", "/v1/completions", {**OK, "logprobs": 21}, AUTH, 400, "logprobs = 21 is out of range; "
     "allowed: None (off), or an integer 0 .. 20", "logprobs"),
    ("negative logprobs", "/v1/completions", {**OK, "logprobs": -1}, AUTH, 400, "0 .. 20", "logprobs"),
    ("presence_penalty over 2", "/v1/completions", {**OK, "presence_penalty": 2.5}, AUTH, 400,
     "presence_penalty = 2.5 is out of range; allowed: -2 <= presence_penalty <= 2", "presence_penalty"),
    ("frequency_penalty under -2", "/v1/completions", {**OK, "frequency_penalty": -3}, AUTH, 400,
     "frequency_penalty = -3.0 is out of range; allowed: -2 <= frequency_penalty <= 2", "frequency_penalty"),
    ("negative min_tokens", "/v1/completions", {**OK, "min_tokens": -1}, AUTH, 400,
     "min_tokens = -1 is out of range", "min_tokens"),
    ("logit_bias key not an id", "/v1/completions", {**OK, "logit_bias": {"abc": 1}}, AUTH, 400,
     "logit_bias key 'abc' is not a token id", "logit_bias"),
    ("logit_bias over 100", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, AUTH, 400,
     "-100 <= bias <= 100", "logit_bias"),
    ("logit_bias id out of vocab", "/v1/completions", {**OK, "logit_bias": {"999": 1}}, AUTH, 400,
     "logit_bias token id 999 is out of range", "logit_bias"),
    ("min_tokens over max_tokens", "/v1/completions", {**OK, "min_tokens": 5}, AUTH, 400,
     "min_tokens = 5 is more than max_tokens = 2", "min_tokens"),
    ("chat min_tokens over max_completion_tokens", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 3, "min_tokens": 4}, AUTH, 400,
     "min_tokens = 4 is more than max_completion_tokens = 3; allowed: min_tokens <= max_completion_tokens",
     "min_tokens"),
    ("chat min_tokens over the deprecated max_tokens", "/v1/chat/completions", {**CHAT, "min_tokens": 4}, AUTH, 400,
     "min_tokens = 4 is more than max_tokens = 2; allowed: min_tokens <= max_tokens", "min_tokens"),
    ("chat min_tokens over the context left", "/v1/chat/completions",
     {"model": "tiny-llama", "messages": CHAT["messages"], "min_tokens": 1000}, AUTH, 400,
     "tokens the context leaves after the messages (no max_completion_tokens given)", "min_tokens"),
    ("prompt_logprobs over 20", "/v1/completions", {**OK, "prompt_logprobs": 21}, AUTH, 400,
     "prompt_logprobs = 21 is out of range; allowed: None (off), or an integer 0 .. 20", "prompt_logprobs"),
    ("negative prompt_logprobs with echo's logprobs", "/v1/completions",
     {**OK, "prompt_logprobs": -1, "echo": True, "logprobs": 2}, AUTH, 400, "prompt_logprobs = -1 is out of range",
     "prompt_logprobs"),
    ("negative prompt_logprobs", "/v1/chat/completions", {**CHAT, "prompt_logprobs": -1}, AUTH, 400,
     "prompt_logprobs = -1 is out of range", "prompt_logprobs"),
    ("prompt_logprobs streamed", "/v1/completions", {**OK, "prompt_logprobs": 1, "stream": True}, AUTH, 400,
     "prompt_logprobs is not available with stream: true", "prompt_logprobs"),
    ("chat echo", "/v1/chat/completions", {**CHAT, "echo": True}, AUTH, 400, "echo is not supported on chat", "echo"),
    ("no messages", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400, "at least 1 item", "messages"),
    ("stream_options without stream", "/v1/completions", {**OK, "stream_options": {"include_usage": True}}, AUTH,
     400, "streamed responses only", "stream_options"),
    ("chat stream_options without stream", "/v1/chat/completions", {**CHAT, "stream_options": {}}, AUTH, 400,
     "set stream: true", "stream_options"),
    ("empty role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "", "content": "x"}]}, AUTH, 400,
     "at least 1 character", "messages.0.role"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, AUTH, 400,
     "needs logprobs: true", "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, AUTH, 400,
     "top_logprobs = 21 is out of range", "top_logprobs"),
    ("logprobs not a boolean", "/v1/chat/completions", {**CHAT, "logprobs": "yes please"}, AUTH, 400,
     "valid boolean", "logprobs"),
    ("image content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, AUTH, 400, "only text parts", "messages"),
    ("unknown route", "/v1/embeddings", {}, AUTH, 404, "no route POST /v1/embeddings", None),
    ("n over vLLM's limit", "/v1/completions", {**OK, "n": 16385}, AUTH, 400, "less than or equal to 16384", "n"),
]


@pytest.fixture(scope="module")
def server(llm):
    eng = llm_engine(llm, num_blocks=128)
    with serve_llm(llm, engine=eng, api_key=KEY, max_body_bytes=4096, max_prompt_tokens=64) as url:
        yield url


def post(url: str, path: str, body, headers: dict) -> httpx.Response:
    if body is None:
        return httpx.get(url + path, headers=headers, timeout=60)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json", **headers}, timeout=60)


def test_the_table_has_at_least_20_cases():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("path", "body", "key", "n_top"), [
    ("/v1/completions", {**OK, "logprobs": 0}, "top_logprobs", 1),
    ("/v1/completions", {**OK, "logprobs": 20}, "top_logprobs", 20),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, "content", 0),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20}, "content", 20),
])
def test_logprobs_in_range_are_accepted(server, path, body, key, n_top):
    r = post(server, path, {**body, "max_tokens": 1}, AUTH)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    if key == "content":
        assert len(lp["content"]) == 1 and len(lp["content"][0]["top_logprobs"]) == n_top
    else:  # keyed by token text: tokens that decode alike (tiny-llama's undecodable bytes) share one key
        assert len(lp["tokens"]) == 1 and 1 <= len(lp["top_logprobs"][0]) <= n_top + 1
        assert lp["tokens"][0] in lp["top_logprobs"][0] and lp["text_offset"] == [0]


def test_bad_requests_get_status_and_message_while_a_stream_is_unaffected(server):
    body = {"model": "tiny-llama", "prompt": "steady", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    streamed: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.extend(json.loads(line[6:])["choices"][0]["token_ids"])

    t = threading.Thread(target=stream)
    t.start()
    failures = []
    for name, path, req, headers, status, msg, param in CASES:
        r = post(server, path, req, headers)
        err = r.json().get("error", {})
        ok = (r.status_code == status and msg in err.get("message", "") and set(err) >= {"type", "param", "code"}
              and (param is None or err["param"] == param))
        if not ok:
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    t.join(timeout=120)
    assert not failures, "\n".join(failures)
    whole = post(server, "/v1/completions", body, AUTH)
    assert whole.status_code == 200 and streamed == whole.json()["choices"][0]["token_ids"]
    assert len(streamed) == 60
    m = httpx.get(f"{server}/metrics", timeout=30).text
    assert 'kiln_kv_blocks_used{model_name="tiny-llama"} 0.0' in m


# The 400s of CASES whose code is more specific than invalid_value (pydantic's type errors, unknown fields, the
# context); every other 400 naming a field is invalid_value, the route's own checks as much as pydantic's.
SPECIFIC_CODES = {"body not an object": "invalid_type", "max_tokens a word": "invalid_type",
                  "seed a float": "invalid_type", "stream a list": "invalid_type", "unknown field": "unknown_field",
                  "prompt a number": "invalid_type", "logprobs not a boolean": "invalid_type",
                  "prompt over the limit": "context_length_exceeded",
                  "prompt + max_tokens over the context": "context_length_exceeded"}


def test_every_400_naming_a_field_has_a_code(server):
    got = {}
    for name, path, req, headers, status, _, param in CASES:
        if status == 400 and param is not None:
            got[name] = post(server, path, req, headers).json()["error"]["code"]
    want = {name: SPECIFIC_CODES.get(name, "invalid_value") for name in got}
    assert got == want and len(got) > 40


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
    assert "kiln_time_to_first_token_seconds" in httpx.get(f"{server}/metrics", timeout=30).text


def test_a_full_queue_answers_503_with_retry_after(llm):
    long = {"model": "tiny-llama", "prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}
    # 200 tokens then take >= 4 s: A cannot finish (and B start) before C is refused
    slow = llm_engine(llm, num_blocks=128, max_num_seqs=1, step_s=0.02)
    with serve_llm(llm, engine=slow, max_waiting=1) as url:
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long) as a:
                next(a.iter_lines())  # A runs
                with c.stream("POST", "/v1/completions", json=long) as b:  # B waits: the queue is full
                    assert b.status_code == 200
                    r = c.post("/v1/completions", json=OK)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "queue holds 1" in r.json()["error"]["message"] and r.json()["error"]["code"] == "queue_full"
            # Closing A and B aborts them on the engine thread; a client honouring Retry-After gets served.
            for _ in range(100):
                if (r := c.post("/v1/completions", json=OK)).status_code != 503:
                    break
                time.sleep(0.1)
            assert r.status_code == 200


def test_an_engine_failure_fails_the_requests_in_flight_and_the_server_goes_on(llm):
    from kiln.runtime.engine import Engine

    class FailOnce(Engine):
        armed = True

        def step(self):
            if self.armed and self.requests:
                self.armed = False
                raise RuntimeError("simulated device fault")
            return super().step()

    eng = llm_engine(llm, FailOnce, num_blocks=128)
    with serve_llm(llm, engine=eng) as url:
        r = httpx.post(f"{url}/v1/completions", json=OK, timeout=60)
        assert r.status_code == 500 and "simulated device fault" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "engine_failure"
        assert httpx.post(f"{url}/v1/completions", json=OK, timeout=60).status_code == 200
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert not eng.block_manager.tables


@pytest.mark.parametrize(("header", "status"), [
    (f"bearer {KEY}", 200), (f"BEARER  {KEY}", 200), (f"Bearer {KEY}x", 401), ("Bearer", 401), (f"Basic {KEY}", 401),
])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(server, header, status):
    assert post(server, "/v1/models", None, {"Authorization": header}).status_code == status
