"""vLLM's chat fields add_generation_prompt and continue_final_message: the prompt kiln renders is the one
transformers' apply_chat_template gives for the same flags (kiln's default template, Llama 3's, ChatML), and vLLM's
refusals (both flags true; a final message without content) are 400s naming the field."""

from __future__ import annotations

import pytest

from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")

# Meta-Llama-3-8B-Instruct's template as published (it trims each message's text), and ChatML (Qwen, Hermes).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BOS = "<|begin_of_text|>"
TEMPLATES = {"default": DEFAULT_CHAT_TEMPLATE, "llama3": LLAMA3, "chatml": CHATML}


def _convo(final: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": final}]


@pytest.fixture(scope="module")
def hf():
    """A transformers tokenizer built in memory (no download): only its apply_chat_template is used."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token=BOS)


def test_the_default_template_continues_the_final_message():
    tpl = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    msgs = _convo("Once upon a")
    assert tpl.render(msgs, False, continue_final_message=True) == \
        "<|system|>\nBe brief.\n<|user|>\nTell me a story.\n<|assistant|>\nOnce upon a"
    assert tpl.render(msgs, False) == tpl.render(msgs, False, continue_final_message=True) + "\n"
    with pytest.raises(ValueError, match="cannot both be true"):
        tpl.render(msgs, True, continue_final_message=True)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("final", ["Once upon a", "Sure, ", "", "  x\n"])
def test_continue_final_message_renders_as_transformers(hf, name, final):
    """Trailing spaces, leading spaces and an empty message included: Llama 3's template trims the text, which
    transformers' cut follows."""
    msgs = _convo(final)
    ours = ChatTemplate(TEMPLATES[name], bos_token=BOS)
    for add, cont in ((False, True), (False, False), (True, False)):
        want = hf.apply_chat_template(msgs, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=add,
                                      continue_final_message=cont)
        assert ours.render(msgs, add, continue_final_message=cont) == want, (add, cont)


def test_a_template_that_drops_the_final_message_cannot_continue_it():
    tpl = ChatTemplate("{% for m in messages[:-1] %}{{ m.content }}{% endfor %}", origin="drops.jinja")
    with pytest.raises(ChatTemplateError, match=r"\(drops.jinja\) does not render the final message's text"):
        tpl.render(_convo("abc"), False, continue_final_message=True)


@pytest.fixture(scope="module")
def llama3_url(llm):
    with serve_llm(llm, chat_template=ChatTemplate(LLAMA3, bos_token=BOS)) as u:
        yield u


def _chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                          "return_token_ids": True, **body}, timeout=60)


def _prompt_ids(r: httpx.Response) -> list[int]:
    """The prompt's ids as the server tokenized it, read from vLLM's prompt_logprobs field (0: the token itself;
    the first token has no entry)."""
    assert r.status_code == 200, r.text
    body = r.json()
    field = body["prompt_logprobs"]
    assert field[0] is None and len(field) == body["usage"]["prompt_tokens"]
    return [int(next(iter(entry))) for entry in field[1:]]


@pytest.mark.parametrize(("flags", "add", "cont"), [
    ({}, True, False),
    ({"add_generation_prompt": False}, False, False),
    ({"add_generation_prompt": False, "continue_final_message": True}, False, True),
])
def test_the_server_prompt_is_transformers(llama3_url, llm, hf, flags, add, cont):
    msgs = _convo("Once upon a time, ")[1:]  # Llama 3's markup is long in tiny-llama's bytes: 256 in all
    want = llm.tokenizer.encode(hf.apply_chat_template(msgs, chat_template=LLAMA3, tokenize=False,
                                                       add_generation_prompt=add, continue_final_message=cont))
    r = _chat(llama3_url, {"messages": msgs, "prompt_logprobs": 0, **flags})
    assert _prompt_ids(r) == want[1:] and r.json()["usage"]["prompt_tokens"] == len(want)
    # the reply continues that prompt: the completion of its text gives the same tokens
    plain = httpx.post(f"{llama3_url}/v1/completions", json={"prompt": want, "max_tokens": 3, "temperature": 0,
                                                             "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "continue_final_message and add_generation_prompt cannot both be true"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt defaults to true"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]}, "messages",
     "the final message has no content to continue"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "valid boolean"),
])
def test_vllms_refusals_are_400s_naming_the_field(url, body, param, words):
    r = _chat(url, {"messages": _convo("Once"), **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text
    assert err["code"] in ("invalid_value", "invalid_type")


def test_a_template_that_drops_the_final_message_is_a_400(llm):
    tpl = ChatTemplate("{% for m in messages[:-1] %}{{ m.content }}{% endfor %}", origin="drops.jinja")
    with serve_llm(llm, chat_template=tpl) as u:
        r = _chat(u, {"messages": _convo("Once"), "continue_final_message": True, "add_generation_prompt": False})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "invalid_value"), r.text
    assert "does not render the final message's text" in err["message"]
