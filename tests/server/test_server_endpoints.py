"""vLLM's endpoints beside the OpenAI ones (/tokenize, /detokenize, /version, /ping), CORS as vLLM's flags set it,
the 404 that lists what kiln serves, several served model names, the body cap and an unlimited waiting queue."""

from __future__ import annotations

import json
import threading

import pytest

from tests.support.served_llm import llm_engine, serve_llm
from tests.support.word_tokenizer import BOS, write_word_tokenizer

httpx = pytest.importorskip("httpx")

MSGS = [{"role": "user", "content": "w1 w2"}]


def _post(url: str, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=60)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A tokenizer.json of words w0 .. w9 whose post-processor puts <s> (id 10) first, as Llama's adds BOS."""
    from kiln.tokenizer import HFTokenizer

    return HFTokenizer(write_word_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def words(llm, word_tokenizer):
    """A server whose model reads words (the word tokenizer), behind an API key."""
    with serve_llm(llm, engine=llm_engine(llm, tokenizer=word_tokenizer, num_blocks=32), api_key="k") as u:
        yield u


AUTH = {"Authorization": "Bearer k"}


def test_tokenize_a_prompt_with_or_without_special_tokens(words):
    r = _post(words, "/tokenize", {"model": "tiny-llama", "prompt": "w1 w2 w3"}, AUTH).json()
    assert r == {"count": 4, "max_model_len": 256, "tokens": [BOS, 1, 2, 3], "token_strs": None}
    r = _post(
        words, "/tokenize", {"prompt": "w1 w2 w3", "add_special_tokens": False, "return_token_strs": True}, AUTH
    ).json()
    assert r["tokens"] == [1, 2, 3] and r["token_strs"] == ["w1", "w2", "w3"] and r["count"] == 3
    r = _post(words, "/tokenize", {"prompt": "w4", "return_token_strs": True}, AUTH).json()
    assert r["token_strs"] == ["<s>", "w4"]


def test_tokenize_messages_gives_the_chat_prompt(words):
    """The messages form renders as /v1/chat/completions does, so count is what a chat request's prompt_tokens
    will be; add_generation_prompt and add_special_tokens change it as in vLLM."""
    r = _post(words, "/tokenize", {"messages": MSGS, "return_token_strs": True}, AUTH).json()
    chat = _post(words, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}, AUTH).json()
    # as vLLM's: no special tokens on top of the template's own by default (kiln's default template writes no BOS)
    assert r["count"] == chat["usage"]["prompt_tokens"] == len(r["tokens"]) and r["tokens"][0] != BOS
    no_prompt = _post(words, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}, AUTH).json()
    assert no_prompt["count"] < r["count"] and r["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    with_bos = _post(words, "/tokenize", {"messages": MSGS, "add_special_tokens": True}, AUTH).json()
    assert with_bos["tokens"] == [BOS, *r["tokens"]]
    cont = _post(
        words,
        "/tokenize",
        {
            "messages": [*MSGS, {"role": "assistant", "content": "w5"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        AUTH,
    ).json()
    assert cont["tokens"][-1] == 5
    both = _post(words, "/tokenize", {"messages": MSGS, "continue_final_message": True}, AUTH)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_detokenize_and_its_errors(words, word_tokenizer):
    r = _post(words, "/detokenize", {"model": "tiny-llama", "tokens": [1, 2, 3]}, AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": word_tokenizer.decode([1, 2, 3])} == {"prompt": "w1 w2 w3"}
    for bad, at in (([1, 512], "tokens[1] = 512"), ([-1], "tokens[0] = -1")):
        r = _post(words, "/detokenize", {"tokens": bad}, AUTH)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tokens" and err["code"] == "invalid_value", r.text
        assert err["message"].startswith(f"{at} is not a token id of this model; allowed: 0 .. 511")
    r = _post(words, "/detokenize", {"tokens": ["a"]}, AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenization_routes_check_the_model_the_key_and_the_fields(words, path):
    body = {"prompt": "w1"} if path == "/tokenize" else {"tokens": [1]}
    assert _post(words, path, body).status_code == 401
    r = _post(words, path, {**body, "model": "gpt-4"}, AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(words, path, {**body, "tokns": [1]}, AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"


def test_tokenize_refuses_a_tool_without_a_function(words):
    """Tools render into the prompt (tests/server/test_server_tools.py); one not of OpenAI's shape is a 400."""
    r = _post(words, "/tokenize", {"messages": MSGS, "tools": [{"type": "function"}]}, AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function"


def test_version_and_ping(words):
    from kiln import __version__

    assert httpx.get(f"{words}/version", timeout=30).json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{words}/ping", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_ping_is_503_while_draining(llm):
    """As /health: from the moment the drain is asked for, a load balancer sees 503."""
    from kiln.server import ServerConfig
    from kiln.server.app import build_app
    from kiln.server.drain import DrainingServer

    # by hand, not serve_llm: the app is asked in process while its DrainingServer, never started, is draining
    app = build_app(llm_engine(llm, num_blocks=32), ServerConfig(model_name="tiny-llama"))
    server = DrainingServer(app, 1.0)
    server.should_exit = True
    from starlette.testclient import TestClient

    with TestClient(app) as c:
        for method in ("GET", "POST"):
            r = c.request(method, "/ping")
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def test_an_unknown_route_lists_what_kiln_serves(words):
    r = _post(words, "/v1/responses", {"input": "hi"}, AUTH)
    msg = r.json()["error"]["message"]
    assert r.status_code == 404 and msg.startswith("no route POST /v1/responses; kiln serves ")
    for route in (
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /v1/models",
        "POST /tokenize",
        "POST /detokenize",
        "GET /version",
        "GET /ping",
        "POST /ping",
        "GET /health",
        "GET /metrics",
    ):
        assert route in msg
    assert "under /v1" not in msg
    r = _post(words, "/chat/completions", {}, AUTH)  # a base URL without /v1
    assert r.status_code == 404 and "did you mean POST /v1/chat/completions?" in r.json()["error"]["message"]


def test_cors_preflight_and_headers(words):
    pre = httpx.options(
        f"{words}/v1/chat/completions",
        timeout=30,
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200, pre.text  # answered before the API key is asked for
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{words}/v1/models", headers={"Origin": "http://app.example", **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    denied = httpx.get(f"{words}/v1/models", headers={"Origin": "http://app.example"}, timeout=30)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"  # readable by the page


def test_cors_origins_methods_and_credentials_as_configured(llm):
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), allowed_origins=["https://ok.example"],
                   allowed_methods=["POST"], allowed_headers=["content-type"], allow_credentials=True) as u:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = httpx.options(f"{u}/v1/completions", headers={"Origin": "https://ok.example", **ask}, timeout=30)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(f"{u}/v1/completions", headers={"Origin": "https://evil.example", **ask}, timeout=30)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = httpx.options(
            f"{u}/v1/completions",
            timeout=30,
            headers={"Origin": "https://ok.example", "Access-Control-Request-Method": "PUT"},
        )
        assert put.status_code == 400


def test_several_served_names(llm):
    """vLLM's --served-model-name a b: a is reported, both are listed and accepted; an alias is accepted only."""
    eng = llm_engine(llm, num_blocks=32)
    with serve_llm(llm, engine=eng, model_name=["org/model-a", "b"], model_aliases=["tiny-llama"]) as u:
        assert [c["id"] for c in httpx.get(f"{u}/v1/models", timeout=30).json()["data"]] == ["org/model-a", "b"]
        for name in ("org/model-a", "b", "tiny-llama", "", None):
            r = _post(u, "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "org/model-a", (name, r.text)
        r = _post(u, "/v1/completions", {"model": "c", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 404 and "serves 'org/model-a' or 'b'" in r.json()["error"]["message"]
        assert httpx.get(f"{u}/v1/models/b", timeout=30).json()["id"] == "b"
        assert httpx.get(f"{u}/v1/models/org/model-a", timeout=30).json()["id"] == "org/model-a"
        assert httpx.get(f"{u}/health", timeout=30).json()["model"] == "org/model-a"
        assert 'model_name="org/model-a"' in httpx.get(f"{u}/metrics", timeout=30).text


def test_a_long_prompt_as_token_ids_fits_the_default_body_cap(url):
    """150k token ids of a 128k vocabulary are ~1.2 MB of JSON: refused for the context (tiny-llama's 256), not for
    the body's size."""
    ids = [100_000 + i % 28_000 for i in range(150_000)]
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    assert len(body) > 1 << 20
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_the_413_names_the_limit_and_the_flag(llm):
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), max_body_bytes=2 << 20) as u:
        r = _post(u, "/v1/completions", {"prompt": [1] * 1_200_000, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "request_too_large"
        assert "limit of 2 MiB, 2097152 bytes" in err["message"] and "--max-body-bytes" in err["message"]


def test_many_choices_queue_without_a_limit_by_default(url):
    """vLLM queues without limit: 16 prompts x n 20 (320, over the old 256 cap) are all served."""
    r = _post(url, "/v1/completions", {"prompt": [[1]] * 16, "n": 20, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 320


def test_prompts_in_one_request_are_bounded_as_in_vllm(url):
    r = _post(url, "/v1/completions", {"prompt": [[1]] * 1025, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "over the limit of 1024" in err["message"]


def test_a_bounded_queue_says_why_a_request_bigger_than_it_is_refused(llm):
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), max_waiting=4) as u:
        r = _post(u, "/v1/completions", {"prompt": "Hi", "n": 5, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n"
        assert (
            "over the 4 requests the server's queue holds (--max-waiting), so it could never be admitted"
            in err["message"]
        )
        assert _post(u, "/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 1}).status_code == 200


def test_tokenize_runs_off_the_event_loop(words, monkeypatch, word_tokenizer):
    """A long text's tokenization must not stall the streams being served."""
    seen: list[str] = []
    real = type(word_tokenizer).encode

    def encode(self, text, **kw):
        seen.append(threading.current_thread().name)
        return real(self, text, **kw)

    monkeypatch.setattr(type(word_tokenizer), "encode", encode)
    assert _post(words, "/tokenize", {"prompt": "w1"}, AUTH).status_code == 200
    assert seen and all(name != "kiln-server" for name in seen)
