"""What a soak of `kiln serve` found: the choices of one request start in the same engine step, /metrics shows the
pool (and the prefix cache's counters) from the start, a route's unexpected exception and a deeply nested body are
JSON errors, one error code rule for values out of range, lone surrogates named as such, and the model checked
first, with OpenAI's error type."""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.served_llm import llm_engine, serve_llm

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def url(llm):
    with serve_llm(llm, max_prompt_tokens=64) as u:
        yield u


def _post(url: str, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_choices_of_one_request_are_added_between_the_same_two_steps(llm):
    """n x prompts engine requests enter the engine together: no choice starts a step after another."""
    from kiln.runtime.engine import Engine

    class Recording(Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.added_at: dict[str, int] = {}

        def add_request(self, prompt, params, request_id=None, **kw):
            rid = super().add_request(prompt, params, request_id, **kw)
            self.added_at[rid] = self.num_steps
            return rid

        def step(self):
            time.sleep(0.01)  # a step long enough that adds posted one by one would land between steps
            return super().step()

    eng = llm_engine(llm, Recording)
    with serve_llm(llm, engine=eng) as u:
        r = _post(u, {"prompt": ["a", "b"], "n": 4, "max_tokens": 6, "ignore_eos": True, "seed": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8 and len(eng.added_at) == 8
    assert len(set(eng.added_at.values())) == 1, eng.added_at


def test_a_bad_prompt_in_a_batch_adds_none_of_its_choices(llm):
    eng = llm_engine(llm)
    with serve_llm(llm, engine=eng) as u:
        r = _post(u, {"prompt": [[1, 2], [3, 10**6]], "n": 2, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        time.sleep(0.2)  # choices left in the engine would run now
        assert eng.num_steps == 0 and not eng.has_unfinished()


def test_metrics_show_the_pool_before_any_request_and_count_prefix_cache_blocks(llm):
    eng = llm_engine(llm)
    with serve_llm(llm, engine=eng) as u:
        got = _metrics(u)
        assert got["kiln_kv_blocks_total"] == eng.block_manager.num_usable_blocks > 0
        assert got["kiln_kv_blocks_used"] == 0 and got["kiln_prefix_cache_queries_total"] == 0
        prompt = list(range(1, 41))  # two full blocks of 16, then a partial one
        for _ in range(2):
            assert _post(u, {"prompt": prompt, "max_tokens": 2}).status_code == 200
        got = _metrics(u)
    st = eng.stats
    assert st.prefix_cache_hits > 0
    assert got["kiln_prefix_cache_queries_total"] == st.prefix_cache_queries
    assert got["kiln_prefix_cache_hits_total"] == st.prefix_cache_hits


def test_a_deeply_nested_body_is_a_400_invalid_json(url):
    r = _post(url, b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "nests arrays / objects too deeply" in err["message"]
    assert _post(url, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_an_unexpected_exception_is_a_json_500_logged_with_its_traceback(llm, caplog):
    class Broken:  # a chat template with a bug in it (not a ChatTemplateError): the route does not expect it
        origin = "broken"

        def render(self, messages, add_generation_prompt=True, *, continue_final_message=False):
            raise ZeroDivisionError("division by zero in the template")

    with serve_llm(llm, chat_template=Broken()) as u:
        with caplog.at_level(logging.ERROR, logger="kiln"):
            r = _post(u, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "internal_error",
                                      "param": None, "code": None}}
        assert "ZeroDivisionError: division by zero in the template" in r.json()["error"]["message"]
        assert _post(u, {"prompt": "hi", "max_tokens": 1}).status_code == 200  # still serving
    (rec,) = [r for r in caplog.records if r.name.startswith("kiln") and r.exc_info]
    assert "POST /v1/chat/completions" in rec.getMessage() and rec.exc_info[0] is ZeroDivisionError


@pytest.mark.parametrize(("body", "param"), [
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "temperature": float("inf")},
     "temperature"),
])
def test_a_value_out_of_range_has_code_invalid_value(url, body, param):
    r = _post(url, body, "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and (err["code"], err["param"]) == ("invalid_value", param), err


def test_specific_codes_stay(url):
    err = _post(url, {"prompt": [5] * 60, "max_tokens": 250}).json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")


@pytest.mark.parametrize(("body", "path", "where", "param"), [
    (b'{"prompt": "a\\ud800b"}', "/v1/completions", "field 'prompt'", "prompt"),
    (b'{"prompt": ["ok", "x\\udfff"]}', "/v1/completions", "field 'prompt.1'", "prompt.1"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "/v1/chat/completions",
     "field 'messages.0.content'", "messages.0.content"),
    (b'{"prompt": "hi", "a\\ud800": 1}', "/v1/completions", "the field name 'a\\ud800'", None),
    ('{"prompt": "x\ud800"}'.encode("utf-8", "surrogatepass"), "/v1/completions", "field 'prompt'", "prompt"),
])
def test_a_lone_surrogate_is_named_with_its_field_and_character(url, body, path, where, param):
    err = _post(url, body, path).json()["error"]
    assert err["message"].startswith(f"{where} holds a lone UTF-16 surrogate"), err["message"]
    assert "at character 1" in err["message"] and "send valid UTF-8 text" in err["message"]
    assert err["param"] == param


def test_a_surrogate_pair_is_text(url):
    r = _post(url, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "echo": true}')
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("\U0001f600")


def test_an_unknown_model_is_checked_first_with_openais_error(url):
    for body, path in (({"model": "gpt-4", "prompt": [5] * 1000}, "/v1/completions"),
                       ({"model": "gpt-4", "messages": [{"role": "user", "content": "x" * 1000}]},
                        "/v1/chat/completions")):
        r = _post(url, body, path)
        assert r.status_code == 404, r.text
        assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                      "param": "model", "code": "model_not_found"}
    r = httpx.get(f"{url}/v1/models/gpt-4", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
