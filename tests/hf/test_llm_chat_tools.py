"""LLM.chat with an agent loop's history and tool definitions, as vLLM's LLM.chat takes them: an assistant message
that has tool_calls and no content key, and tools= handed to the chat template as `tools`; the prompt equals
transformers' apply_chat_template(messages, tools=tools)."""

from __future__ import annotations

import pytest

from kiln.errors import RequestError
from tests.support.class_tokenizers import save_class_checkpoint

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% for c in m.get('tool_calls') or [] %}[call {{ c['function']['name'] }}]{% endfor %}"
            "</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
HISTORY = [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-tools")
    save_class_checkpoint("qwen2", d, chat_template=TEMPLATE)
    return d


@pytest.fixture(scope="module")
def llm(checkpoint):
    from kiln import LLM

    return LLM(str(checkpoint), device="cpu", use_kernels=False)


def test_tools_and_a_call_without_content_render_as_transformers_renders_them(checkpoint, llm):
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    want = hf.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert want.startswith("<tools>get_weather;get_time;</tools>") and "[call get_weather]" in want
    assert llm.chat_prompts(HISTORY, tools=TOOLS) == [want]
    no_tools = hf.apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=False)
    assert llm.chat_prompts(HISTORY) == [no_tools] and "<tools>" not in no_tools
    short, tool = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]  # context 64
    out = llm.chat(short, {"max_tokens": 3, "temperature": 0}, tools=tool, use_tqdm=False)
    assert out[0].prompt_token_ids == hf.apply_chat_template(short, tools=tool, add_generation_prompt=True,
                                                             tokenize=True, return_dict=False)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tools": {"type": "function"}}, "tools must be a list of tool definitions"),
    ({"tools": ["get_weather"]}, "tools must be a list of tool definitions"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": TOOLS}}, "tools given twice"),
])
def test_bad_tools_are_named(llm, kwargs, match):
    with pytest.raises(RequestError, match=match) as info:
        llm.chat_prompts(HISTORY, **kwargs)
    assert info.value.param == "tools"


def test_a_message_without_a_role_is_named_by_its_place(llm):
    with pytest.raises(RequestError, match=r"conversation 0, message 1: needs a 'role'"):
        llm.chat_prompts([{"role": "user", "content": "hi"}, {"content": "no role"}])
    with pytest.raises(RequestError, match=r"conversation 0, message 0: needs a 'role'"):
        llm.chat_prompts([{"role": "", "content": "hi"}])
