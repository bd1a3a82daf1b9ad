"""LLM.get_tokenizer() as vLLM's: AutoTokenizer.from_pretrained's, built once (here transformers' own
PreTrainedTokenizerFast, the class the checkpoint names; tests/hf/test_parity_tokenizer_class.py has Llama's, Qwen2's
and GPT-2's), with the checkpoint's settings as transformers reads them; compared call by call with what vLLM
returns for the same checkpoint (AutoTokenizer.from_pretrained): encoding, decoding (special tokens kept by
default), the special tokens and their ids, padding, tensors, apply_chat_template (tokenize=True by default). The
engine's own tokenizer keeps kiln's defaults. Also the checkpoint without tokenizer_config.json, and the errors
without transformers or without a tokenizer.json."""

from __future__ import annotations

import json
import sys

import pytest

from kiln.errors import KilnError
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import encode_text, load_tokenizer
from tests.support.bpe_tokenizer import write_bpe
from tests.support.hf_models import save_hf_model
from tests.support.tokenizer_parity import TEXTS, assert_same_calls, assert_same_chat, assert_same_settings, check
from tests.support.vllm_tokenizer import vllm_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Settings transformers reads besides the special tokens (kiln does not read them: transformers must).
CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
          "additional_special_tokens": ["<|im_end|>"], "model_max_length": 16, "padding_side": "left",
          "clean_up_tokenization_spaces": True, "chat_template": TEMPLATE}
VOCAB = 304  # the model's: past the tokenizer's 302 ids


def _checkpoint(d, config: dict | None) -> None:
    """A tiny Llama saved by transformers (config.json: BOS 1, EOS 2, padding 0); write_bpe's vocabulary (<unk> 0,
    <s> 1, </s> 2) with Llama's post-processor (BOS before every text) and two tokens added past its 300 ids, a
    special one and a plain one; tokenizer_config.json unless `config` is None."""
    from tokenizers import processors

    save_hf_model("llama", d, vocab_size=VOCAB)
    raw = write_bpe(d)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.add_special_tokens(["<|im_end|>"])
    raw.add_tokens(["<tool>"])
    raw.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))


def _vllm_tokenizer(d):
    """What vLLM's LLM.get_tokenizer() returns for the checkpoint: AutoTokenizer's, truncating on the left."""
    return vllm_tokenizer(d)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    _checkpoint(d, CONFIG)
    return d


@pytest.fixture(scope="module")
def llm(checkpoint):
    from kiln import LLM

    return LLM(str(checkpoint), device="cpu", use_kernels=False)


def test_get_tokenizer_is_transformers_own_made_once_apart_from_kilns_backend(llm):
    tok = llm.get_tokenizer()
    assert isinstance(tok, transformers.PreTrainedTokenizerFast) and llm.get_tokenizer() is tok
    assert tok.backend_tokenizer is not llm.tokenizer.backend_tokenizer
    tok(["a", "the fox"], padding="max_length", truncation=True, max_length=3)  # sets padding on transformers' copy
    assert llm.tokenizer.backend_tokenizer.padding is None is llm.tokenizer.backend_tokenizer.truncation


def test_every_call_equals_autotokenizers(checkpoint, llm):
    tok, hf = llm.get_tokenizer(), _vllm_tokenizer(checkpoint)
    assert_same_settings(tok, hf)
    assert (tok.pad_token_id, tok.model_max_length, tok.padding_side) == (0, 16, "left")  # read, not defaults
    assert tok.truncation_side == hf.truncation_side == "left"  # as vLLM loads it: a cut prompt keeps its end
    assert tok.all_special_tokens == hf.all_special_tokens and "<|im_end|>" in tok.all_special_tokens
    assert_same_calls(tok, hf, TEXTS)
    check(tok, hf, "__call__", "the quick brown fox " * 9, truncation=True)  # model_max_length
    assert_same_chat(tok, hf)
    assert tok.decode([1, 2]) == "<s></s>" and tok.decode([1, 2], skip_special_tokens=True) == ""


def test_the_engine_keeps_kiln_defaults(llm):
    """The user's report: get_tokenizer().decode keeps special tokens, as transformers'; the engine's text does
    not (SamplingParams' skip_special_tokens, vLLM's default), and LLM.chat encodes as apply_chat_template does."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[2], ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": tok.encode("the fox")}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [2, 2, 2] and out.text == "" and tok.decode(out.token_ids) == "</s></s></s>"
    assert llm.tokenizer.decode([1, 2]) == ""  # kiln's own: special tokens skipped by default
    msgs = [{"role": "user", "content": "hello world"}]
    (reply,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert reply.prompt_token_ids == tok(want, add_special_tokens=False)["input_ids"]
    assert reply.prompt_token_ids == encode_text(llm.tokenizer, want, add_special=False)


def test_without_tokenizer_config_the_specials_are_the_config_ids(tmp_path):
    """save_pretrained's config.json / generation_config.json ids (BOS 1, EOS 2, padding 0), as kiln reads EOS;
    AutoTokenizer names none there (docs/vllm_differences.md), and answers every call alike otherwise."""
    _checkpoint(tmp_path, None)
    tok, hf = load_tokenizer(tmp_path, vocab=VOCAB).transformers_tokenizer, _vllm_tokenizer(tmp_path)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast) and hf.special_tokens_map == {}
    assert tok.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 0, None)
    assert_same_settings(tok, hf, ("vocab_size", "model_max_length", "padding_side", "chat_template"))
    for text in TEXTS:
        for add in (True, False):
            check(tok, hf, "encode", text, add_special_tokens=add)
        check(tok, hf, "decode", tok.encode(text) + [2])


def test_without_transformers_a_kiln_error_says_what_to_install(checkpoint, monkeypatch):
    kiln_tok = load_tokenizer(checkpoint, vocab=VOCAB)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(KilnError, match=r"pip install transformers.*llm\.tokenizer"):
        _ = kiln_tok.transformers_tokenizer
    assert kiln_tok.decode(kiln_tok.encode("the fox")) == "the fox"  # kiln's own needs none
    monkeypatch.undo()
    assert isinstance(kiln_tok.transformers_tokenizer, transformers.PreTrainedTokenizerFast)  # no failure cached


def test_the_byte_level_fallback_has_no_transformers_tokenizer():
    """A spec with random weights (no tokenizer.json): vLLM has no tokenizer to give there either."""
    kiln_tok = load_tokenizer(None, vocab=300)
    with pytest.raises(KilnError, match=r"no tokenizer\.json.*use llm\.tokenizer"):
        _ = kiln_tok.transformers_tokenizer
    assert kiln_tok.decode(kiln_tok.encode("hé")) == "hé"
