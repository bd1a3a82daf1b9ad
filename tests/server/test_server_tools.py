"""A chat request's tools, as vLLM's server takes them without a tool parser: with tool_choice "none" (or null) the chat
template renders them into the prompt (the variable tools, each tool as vLLM hands it over), on /v1/chat/completions
and on /tokenize's messages form, and the prompt is transformers' apply_chat_template(messages, tools=tools); the
reply is text, parsed for no tool calls. Any other tool_choice (omitted with tools: "auto") is a 400 naming the field
and saying to send tool_choice "none"; a tool not of OpenAI's shape is a 400 naming where."""

from __future__ import annotations

import pytest

from tests.support.class_tokenizers import save_class_checkpoint
from tests.support.hf_models import edit_config
from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

# Shaped like Qwen2.5's: a system turn listing each tool as JSON when there are tools, then ChatML.
TEMPLATE = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
            "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
MSGS = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-tools")
    save_class_checkpoint("qwen2", d, chat_template=TEMPLATE)
    edit_config(d, max_position_embeddings=512)  # room for the tools' JSON, a token or two a character
    return d


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def url(checkpoint):
    from kiln import LLM

    llm = LLM(str(checkpoint), device="cpu", seed=0, use_kernels=False)
    with serve_llm(llm, model_name="tools") as u:
        yield u


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _chat(url: str, body: dict) -> httpx.Response:
    return _post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "temperature": 0,
                                               "return_token_ids": True, **body})


def _prompt_ids(url: str, path: str, body: dict) -> list[int]:
    """The prompt's ids as the server renders and encodes it: /tokenize's tokens, or (chat, with tool_choice "none")
    the completion's prompt_token_ids."""
    if path == "/tokenize":
        r = _post(url, path, {"messages": MSGS, **body})
    else:
        r = _chat(url, {"tool_choice": "none", **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens" if path == "/tokenize" else "prompt_token_ids"]


def _want(hf, tools, msgs=MSGS) -> list[int]:
    """transformers' prompt ids (the template writes the special tokens: none added, as vLLM's chat encodes)."""
    return hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_the_template_gets_the_tools(hf):
    text = hf.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and '"get_time"' in text
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city"' in text
    assert "<tools>" not in hf.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("choice", [{"tool_choice": "none"}, {"tool_choice": None}, {}])
def test_tokenize_renders_the_tools_as_transformers(url, hf, choice):
    """vLLM's /tokenize takes tools and no tool_choice; kiln's takes "none" too, so a chat body's fields pass."""
    r = _post(url, "/tokenize", {"messages": MSGS, "tools": TOOLS, **choice})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == _want(hf, TOOLS)


@pytest.mark.parametrize("choice", ["none", None])
def test_a_chat_with_tool_choice_none_has_the_tools_in_its_prompt(url, hf, choice):
    """The prompt the reply continues is transformers' with tools; the reply is text (null: vLLM's no tool choice)."""
    r = _chat(url, {"tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == _want(hf, TOOLS) and body["usage"]["prompt_tokens"] == len(_want(hf, TOOLS))
    choice0 = body["choices"][0]
    assert isinstance(choice0["message"]["content"], str) and not choice0["message"].get("tool_calls")
    assert choice0["finish_reason"] in ("stop", "length")
    # the same through the stream
    chunks = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "temperature": 0,
                                                            "return_token_ids": True, "stream": True, "tools": TOOLS,
                                                            "tool_choice": "none"}, timeout=60).text
    assert f'"prompt_token_ids":{_want(hf, TOOLS)}'.replace(" ", "") in chunks.replace(" ", "")


@pytest.mark.parametrize("tools", [[], None])
def test_no_tools_is_the_prompt_without_them(url, hf, tools):
    for body in ({"tools": tools}, {"tools": tools, "tool_choice": "none"}):
        r = _chat(url, body)
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == _want(hf, None), r.text
        assert _post(url, "/tokenize", {"messages": MSGS, **body}).json()["tokens"] == _want(hf, None)


def test_a_tool_reaches_the_template_as_vllms_server_hands_it_over(url, hf):
    """vLLM's server gives the template each tool's model_dump(): type (the default "function" when left out), the
    function's name, description and parameters (null when not given), in that order, and strict when given."""
    sent = [{"function": {"parameters": {"type": "object"}, "name": "f"}},
            {"type": "function", "function": {"name": "g", "strict": True, "description": "G"}}]
    seen = [{"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g", "description": "G", "parameters": None, "strict": True}}]
    assert _want(hf, seen) != _want(hf, sent)
    for path in ("/tokenize", "/v1/chat/completions"):
        assert _prompt_ids(url, path, {"tools": sent}) == _want(hf, seen), path


def test_chat_template_kwargs_tools_win_over_tools_as_in_vllm(url, hf):
    """vLLM lays a request's chat_template_kwargs over the variables it sets (tools among them), so their tools
    replace the request's, as sent (not made over as the tools field's are)."""
    mine = [{"type": "function", "function": {"name": "mine"}}]
    for path in ("/tokenize", "/v1/chat/completions"):
        got = _prompt_ids(url, path, {"tools": TOOLS, "chat_template_kwargs": {"tools": mine}})
        assert got == _want(hf, mine) != _want(hf, TOOLS), path


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("path", "body", "param", "said"), [
    ("/v1/chat/completions", {"tools": TOOLS}, "tools",
     'kiln does not support tools without tool_choice "none" (tool_choice defaults to "auto"'),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice",
     "kiln does not support tool_choice 'auto'"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "kiln does not support tool_choice 'auto'"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     "kiln does not support tool_choice 'required'"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": NAMED}, "tool_choice",
     "kiln does not support tool_choice naming a function"),
    ("/tokenize", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     "kiln does not support tool_choice 'required'"),
])
def test_a_tool_choice_kiln_cannot_honour_is_a_400_saying_to_send_none(url, path, body, param, said):
    r = _post(url, path, {"messages": MSGS, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "unsupported_parameter", r.text
    assert err["message"].startswith(said), err["message"]
    assert "makes no tool calls" in err["message"] and "parses none out of the output" in err["message"]
    assert 'send tool_choice "none" to have the chat template render the tools into the prompt' in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(("tools", "param", "code", "said"), [
    ([{"type": "custom", "custom": {"name": "f"}}], "tools.0.type", "invalid_value",
     "must be \"function\", not 'custom': kiln takes function tools"),
    ([{"type": "function"}], "tools.0.function", "invalid_value", "Field required"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name", "invalid_value",
     "Field required"),
    ([{"type": "function", "function": {"name": ""}}], "tools.0.function.name", "invalid_value", "at least 1"),
    ([{"type": "function", "function": {"name": 3}}], "tools.0.function.name", "invalid_type", "valid string"),
    ([{"type": "function", "function": {"name": "f", "paramters": {}}}], "tools.0.function.paramters",
     "unknown_field", "did you mean 'parameters'?"),
    ({"type": "function", "function": {"name": "f"}}, "tools", "invalid_type", "valid list"),
])
def test_a_tool_not_of_openais_shape_is_a_400_naming_where(url, path, tools, param, code, said):
    r = _post(url, path, {"messages": MSGS, "tools": tools, "tool_choice": "none"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == code, r.text
    assert said in err["message"]


def test_a_tool_choice_of_no_kind_is_invalid(url):
    r = _chat(url, {"tools": TOOLS, "tool_choice": "always"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice" and err["code"] == "invalid_value", r.text
    assert err["message"].startswith('tool_choice must be "none", "auto", "required" or a named function')
