"""Chat templates for `kiln serve`: the checkpoint's own from tokenizer_config.json, else the default."""

from __future__ import annotations

import json

import pytest

from kiln.errors import KilnError
from kiln.server.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, load_chat_template

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def test_default_template_without_a_checkpoint():
    tpl = load_chat_template(None)
    assert tpl.origin == "default" and tpl.render(MSGS) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"


def test_checkpoint_template_with_its_special_tokens(tmp_path):
    src = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": src, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tpl = load_chat_template(tmp_path)
    assert tpl.render(MSGS) == "<s>[system]S</s>[user]U</s>[assistant]"


def test_named_templates_take_the_default_one(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}))
    assert load_chat_template(tmp_path).render(MSGS) == "D2"


def test_a_template_that_does_not_parse_names_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(KilnError, match="tokenizer_config.json does not parse"):
        load_chat_template(tmp_path)


def test_raise_exception_in_a_template_surfaces_its_message():
    tpl = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ValueError, match="user first"):
        tpl.render(MSGS)
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(MSGS[1:]).endswith("<|assistant|>\n")
