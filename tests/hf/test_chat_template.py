"""Chat templates (kiln.chat_template): a checkpoint's tokenizer_config.json template rendered as transformers
renders it, a GGUF's through the same renderer, kiln's default for a model without one, and errors that name the
template."""

from __future__ import annotations

import json

import pytest

from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template
from kiln.tokenizer import load_tokenizer
from tests.support.bpe_tokenizer import write_bpe

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

# Shaped like Qwen2.5's template: `if tools` on a variable the caller did not pass, loop controls, tojson.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for t in tools %}{{ t | tojson }}{%- endfor %}"
    "{%- else %}{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'ignored' %}{% continue %}{% endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_default_template():
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(MSGS) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"


def test_no_tokenizer_config_means_no_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None


def test_checkpoint_template_with_its_special_tokens(tmp_path):
    src = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": src, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tpl = load_chat_template(tmp_path)
    assert tpl.render(MSGS) == "<s>[system]S</s>[user]U</s>[assistant]"
    assert tpl.render(MSGS, add_generation_prompt=False) == "<s>[system]S</s>[user]U</s>"


def test_named_templates_take_the_default_one(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}))
    assert load_chat_template(tmp_path).render(MSGS) == "D2"


def test_a_template_that_does_not_parse_names_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json does not parse"):
        load_chat_template(tmp_path)


def test_raise_exception_and_render_failures_name_the_template():
    tpl = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}",
                       origin="my.json")
    with pytest.raises(ChatTemplateError, match=r"\(my.json\) refused the conversation: user first"):
        tpl.render(MSGS)
    assert tpl.render(MSGS[1:]) == ""
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(MSGS)


def test_checkpoint_template_renders_as_transformers_does(tmp_path):
    """A real checkpoint's tokenizer through kiln and through transformers: same prompt text, same ids."""
    transformers = pytest.importorskip("transformers")
    write_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN_LIKE, "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path, vocab=300)
    for msgs in (MSGS, MSGS[1:], [*MSGS, {"role": "ignored", "content": "x"}, {"role": "assistant", "content": "A"}]):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(msgs) == want
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>é</b>"}}]
    assert ChatTemplate(QWEN_LIKE).render(MSGS).startswith("<|im_start|>system\nS<|im_end|>")
    assert '"<b>é</b>"' in ChatTemplate("{{ tools[0].function.description | tojson }}")._template.render(
        tools=tools)  # tojson as transformers': no HTML escaping, no \\u escapes


def test_a_checkpoint_without_a_template_says_so_for_chat(tmp_path):
    write_bpe(tmp_path)
    tok = load_tokenizer(tmp_path, vocab=300)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        tok.apply_chat_template(MSGS)


def test_a_broken_template_does_not_stop_plain_use(tmp_path):
    write_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    tok = load_tokenizer(tmp_path, vocab=300)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tok.apply_chat_template(MSGS)


def test_llm_chat_and_kiln_run_chat_use_the_checkpoints_template(tmp_path, capsys):
    """A Llama checkpoint with a BOS post-processor and a template (as transformers >= 4.43 saves it, in
    chat_template.jinja) that writes bos_token itself: LLM.chat, `kiln run --chat` and transformers all build
    the same prompt ids (one BOS), and chat's output is generate's on that prompt."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import processors

    from kiln import LLM, SamplingParams
    from kiln.cli import main
    from tests.support.hf_models import save_hf_model

    raw = write_bpe(tmp_path)
    save_hf_model("llama", tmp_path, vocab_size=raw.get_vocab_size())
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "the lazy fox"}]
    want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)

    llm = LLM(None, weights=tmp_path, device="cpu")
    (prompt,) = llm.chat_prompts(msgs)
    assert llm.tokenizer.encode(prompt) == want and want.count(bos) == 1
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(msgs, params)
    assert out.prompt_token_ids == want
    (plain,) = llm.generate(prompt_token_ids=want, sampling_params=params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids

    assert main(["run", "--weights", str(tmp_path), "--device", "cpu", "--chat", "--prompt", "the lazy fox",
                 "--max-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == want


def test_llm_chat_checks_its_conversations():
    from kiln import LLM
    from kiln.errors import RequestError

    llm = LLM("tiny-llama", device="cpu", use_kernels=False)
    assert llm.chat_prompts([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]) == [
        "<|user|>\na\n<|assistant|>\n", "<|user|>\nb\n<|assistant|>\n"]  # kiln's default: tiny-llama has none
    for bad in ([], "hi", {"role": "user"}, [{"content": "no role"}], [[]]):
        with pytest.raises(RequestError, match="conversation|messages"):
            llm.chat(bad)
