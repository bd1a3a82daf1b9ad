"""Request fields beyond kiln's own, sorted as a vLLM user expects: metadata of the OpenAI / vLLM schemas is accepted
and ignored (each name logged once per server), fields kiln cannot honour that would change the output are a 400
saying kiln does not support them (unless the value asks for nothing), and a typo is refused with the closest known
field. Also: any non-empty role (the template decides), vLLM's request_id and return_tokens_as_token_ids."""

from __future__ import annotations

import json
import logging

import pytest

from tests.support.served_llm import llm_engine, serve_llm

httpx = pytest.importorskip("httpx")

MSGS = [{"role": "user", "content": "Hi"}]
COMP = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny-llama", "messages": MSGS, "max_tokens": 2, "temperature": 0}


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=60)


METADATA = {
    "user": "u-1",
    "priority": 7,
    "store": False,
    "metadata": {"a": "b"},
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "session_id": "s-1",
    "cache_salt": "salt",
    "kv_transfer_params": {"x": 1},
    "vllm_xargs": {"k": 1},
    "length_penalty": 1.0,
    "stream_interval": 4,
    "guided_decoding_backend": "xgrammar",
}
CHAT_METADATA = {"parallel_tool_calls": False, "include_reasoning": True, "mm_processor_kwargs": {}}
# Asking for nothing: the same output as without the field.
NOOPS = {
    "response_format": {"type": "text"},
    "use_beam_search": False,
    "bad_words": [],
    "watermarking": False,
    "thinking_token_budget": -1,
}
CHAT_NOOPS = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none", "modalities": ["text"]}


@pytest.mark.parametrize(
    ("path", "base", "extra"),
    [
        ("/v1/completions", COMP, {**METADATA, **NOOPS}),
        ("/v1/chat/completions", CHAT, {**METADATA, **CHAT_METADATA, **NOOPS, **CHAT_NOOPS}),
    ],
)
def test_metadata_and_fields_that_ask_for_nothing_change_nothing(url, path, base, extra):
    plain = _post(url, path, base)
    full = _post(url, path, {**base, **extra})
    assert plain.status_code == full.status_code == 200, full.text
    assert [c.get("text", c.get("message")) for c in full.json()["choices"]] == [
        c.get("text", c.get("message")) for c in plain.json()["choices"]
    ]


def test_each_ignored_field_is_logged_once_per_server(llm, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server")
    msgs = [
        {"role": "user", "content": "Hi", "id": "m-1", "refusal": None},
        {"role": "assistant", "content": "Hello", "refusal": "no", "annotations": []},
        MSGS[0],
    ]
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32)) as u:
        for _ in range(3):
            assert (
                _post(
                    u,
                    "/v1/chat/completions",
                    {**CHAT, "messages": msgs, "user": "u", "priority": -3, "metadata": {"k": "v"}},
                ).status_code
                == 200
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.server" and r.levelno == logging.INFO]
    for name in (
        "'user'",
        "'priority'",
        "'metadata'",
        "'messages[].id'",
        "'messages[].refusal'",
        "'messages[].annotations'",
    ):
        assert sum(name in line for line in lines) == 1, (name, lines)
    assert any("'priority'" in line and "first come, first served" in line for line in lines)
    assert not any("'messages[].function_call'" in line for line in lines)  # null: nothing was sent


@pytest.mark.parametrize(
    ("path", "body", "param", "said"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}},
            "response_format",
            "response_format of type 'json_object'",
        ),
        (
            "/v1/completions",
            {**COMP, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
            "response_format of type 'json_schema'",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
            "makes no tool calls",
        ),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice", "tool_choice 'auto'"),
        (
            "/v1/chat/completions",
            {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "makes no tool calls",
        ),
        ("/v1/completions", {**COMP, "guided_json": {"type": "object"}}, "guided_json", "no structured outputs"),
        ("/v1/chat/completions", {**CHAT, "guided_choice": ["a", "b"]}, "guided_choice", "no structured outputs"),
        (
            "/v1/completions",
            {**COMP, "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
            "no structured outputs",
        ),
        ("/v1/completions", {**COMP, "use_beam_search": True}, "use_beam_search", "no beam search"),
        ("/v1/chat/completions", {**CHAT, "documents": [{"title": "t", "text": "x"}]}, "documents", "no documents"),
        ("/v1/completions", {**COMP, "bad_words": ["x"]}, "bad_words", "banned-words"),
        ("/v1/completions", {**COMP, "prompt_embeds": "AAAA"}, "prompt_embeds", "text or token ids"),
        ("/v1/completions", {**COMP, "best_of": 3}, "best_of", "best_of > n"),
    ],
)
def test_fields_kiln_cannot_honour_are_unsupported_not_unknown(url, path, body, param, said):
    r = _post(url, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "unsupported_parameter", r.text
    assert err["message"].startswith(f"kiln does not support {param}") and said in err["message"]
    assert "unknown field" not in err["message"]


def test_best_of_equal_to_n_is_n_and_below_n_is_invalid(url):
    assert _post(url, "/v1/completions", {**COMP, "n": 2, "best_of": 2}).status_code == 200
    r = _post(url, "/v1/completions", {**COMP, "n": 2, "best_of": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    assert "best_of >= n" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "closest"),
    [
        ("/v1/completions", {**COMP, "temprature": 0.5}, "temprature", "temperature"),
        ("/v1/completions", {**COMP, "max_token": 3}, "max_token", "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_token": 3}, "max_completion_token", "max_completion_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "contnet": "Hi"}]},
            "messages.0.contnet",
            "content",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stream_options": {"include_usge": True}},
            "stream_options.include_usge",
            "include_usage",
        ),
    ],
)
def test_a_typo_is_refused_with_the_closest_known_field(url, path, body, param, closest):
    r = _post(url, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unknown_field" and err["param"] == param, r.text
    assert err["message"] == f"unknown field {param!r}; did you mean {closest!r}?"


@pytest.mark.parametrize("name", ["frobnicate", "truncation_side"])
@pytest.mark.parametrize(("path", "base"), [("/v1/completions", COMP), ("/v1/chat/completions", CHAT)])
def test_a_field_kiln_does_not_take_is_unknown_and_not_taken_for_a_typo(url, name, path, base):
    """Nothing close (frobnicate), or a vLLM field kiln does not take yet: no misleading "did you mean"
    (truncation_side is not a typo of truncate_prompt_tokens)."""
    r = _post(url, path, {**base, name: 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unknown_field" and err["param"] == name
    assert err["message"].startswith(f"unknown field {name!r}; remove it") and "did you mean" not in err["message"]


def test_any_non_empty_role_reaches_the_template(llm):
    """As vLLM: the role is the template's business. Kiln's default template writes it; one that refuses roles it
    does not know says so through raise_exception, a 400."""
    from kiln.chat_template import ChatTemplate

    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32)) as u:
        msgs = [{"role": "narrator", "content": "x"}, {"role": "ipython", "content": "y"}]
        tok = _post(u, "/tokenize", {"messages": msgs}).json()["tokens"]
        text = _post(u, "/detokenize", {"tokens": tok}).json()["prompt"]
        assert text == "<|narrator|>\nx\n<|ipython|>\ny\n<|assistant|>\n"
        assert _post(u, "/v1/chat/completions", {**CHAT, "messages": msgs}).status_code == 200
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), chat_template=strict) as u:
        r = _post(u, "/v1/chat/completions", {**CHAT, "messages": [{"role": "narrator", "content": "x"}]})
        assert r.status_code == 400 and "unknown role narrator" in r.json()["error"]["message"]
        bad = _post(u, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.content"


def test_an_assistants_reasoning_reaches_the_template_under_both_names(llm):
    """vLLM renames reasoning_content to reasoning and gives the template both (Qwen3's reads reasoning_content)."""
    from kiln.chat_template import ChatTemplate

    tpl = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}[{{ m.reasoning_content }}|{{ m.reasoning }}]\n{% endfor %}"
    )
    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), chat_template=tpl) as u:
        msgs = [
            {"role": "user", "content": "q", "reasoning_content": "hidden"},
            {"role": "assistant", "content": "a", "reasoning_content": "because"},
            {"role": "assistant", "content": "b", "reasoning": "so"},
        ]
        tok = _post(u, "/tokenize", {"messages": msgs}).json()["tokens"]
        assert (
            _post(u, "/detokenize", {"tokens": tok}).json()["prompt"]
            == "user:q[|]\nassistant:a[because|because]\nassistant:b[so|so]\n"
        )


def test_request_id_names_the_response_and_x_request_id_wins(url):
    r = _post(url, "/v1/completions", {**COMP, "request_id": "abc-1"})
    assert r.json()["id"] == "cmpl-abc-1"
    r = _post(url, "/v1/chat/completions", {**CHAT, "request_id": "abc-2"}, headers={"X-Request-Id": "hdr-9"})
    assert r.json()["id"] == "chatcmpl-hdr-9"
    # two requests with the same id at once are still two engine requests
    with httpx.Client(base_url=url, timeout=60) as c:
        body = {
            **COMP,
            "request_id": "same",
            "stream": True,
            "max_tokens": 4,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        with c.stream("POST", "/v1/completions", json=body) as a, c.stream("POST", "/v1/completions", json=body) as b:
            events = [[json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")] for s in (a, b)]
    for chunks in events:  # each got its own 4 tokens, under the id it asked for
        assert {e["id"] for e in chunks} == {"cmpl-same"}
        assert sum(len(e["choices"][0]["token_ids"]) for e in chunks) == 4


def test_return_tokens_as_token_ids_names_tokens_by_id(url):
    r = _post(
        url, "/v1/completions", {**COMP, "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}
    ).json()["choices"][0]
    ids = r["token_ids"]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for k in top)
    chat = _post(
        url, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    ).json()["choices"][0]
    entry = chat["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]).decode() == entry["token"]
    assert entry["top_logprobs"][0]["token"].startswith("token_id:")
