"""LLM.get_tokenizer() of the class the checkpoint names, as vLLM's (AutoTokenizer.from_pretrained's): for Llama
(tokenizer_class LlamaTokenizerFast), Qwen2 (Qwen2TokenizerFast) and GPT-2 (none named: the model type's
GPT2Tokenizer) checkpoints built offline, type(get_tokenizer()) is type(AutoTokenizer's) and every call agrees
(encode, decode, apply_chat_template, the special tokens, the class's own defaults), and kiln's prompt encoding
agrees with it. A Llama-2-style tokenizer.json, which transformers 5's LlamaTokenizer rebuilds into a pipeline that
encodes otherwise: still AutoTokenizer's, with a warning that ids from it are not kiln's encoding. A class
transformers does not know: PreTrainedTokenizerFast, as AutoTokenizer gives; remote code it will not run:
PreTrainedTokenizerFast over kiln's tokenizer, with a warning."""

from __future__ import annotations

import logging

import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import load_tokenizer
from tests.support.class_tokenizers import MODEL_VOCAB, save_class_checkpoint, save_legacy_llama
from tests.support.tokenizer_parity import TEXTS, assert_same_calls, assert_same_chat, assert_same_settings
from tests.support.vllm_tokenizer import vllm_tokenizer

transformers = pytest.importorskip("transformers")

# family -> the name its Hub checkpoints give (GPT-2's give none: its model type's class), resolved by transformers
CLASS_NAMES = {"llama": "LlamaTokenizerFast", "qwen2": "Qwen2TokenizerFast", "gpt2": "GPT2TokenizerFast"}


def _class(name: str):
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return tokenizer_class_from_name(name)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kiln.tokenizer" and r.levelno == logging.WARNING]


@pytest.fixture(scope="module", params=list(CLASS_NAMES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    d = tmp_path_factory.mktemp(family)
    save_class_checkpoint(family, d)
    return d


@pytest.fixture(scope="module")
def llm(checkpoint):
    from kiln import LLM

    return LLM(str(checkpoint), device="cpu", use_kernels=False)


def test_the_class_autotokenizer_picks_answering_every_call_alike(family, checkpoint, llm):
    tok, hf = llm.get_tokenizer(), vllm_tokenizer(checkpoint)
    assert type(tok) is type(hf) is _class(CLASS_NAMES[family]) and llm.get_tokenizer() is tok
    assert type(tok) is not transformers.PreTrainedTokenizerFast  # the family's own, not the generic one
    assert tok.backend_tokenizer is not llm.tokenizer.backend_tokenizer
    assert tok.truncation_side == hf.truncation_side == "left"
    assert_same_settings(tok, hf)
    assert_same_calls(tok, hf)
    assert_same_chat(tok, hf)


def test_the_class_defaults_hold(family, llm):
    """What the class brings that the files do not say: Llama's left padding, GPT-2's <|endoftext|> tokens; Qwen2's
    unknown token (its default <|endoftext|>) stays unset where tokenizer_config.json says null, as Qwen2.5's does."""
    tok = llm.get_tokenizer()
    if family == "llama":
        assert tok.padding_side == "left" and tok.bos_token == "<s>"
    elif family == "qwen2":
        assert (tok.unk_token, tok.pad_token, tok.eos_token, tok.padding_side) == (None, "<|endoftext|>", "<|im_end|>",
                                                                                  "right")
    else:
        assert tok.special_tokens_map == dict.fromkeys(("bos_token", "eos_token", "unk_token"), "<|endoftext|>")


def test_kilns_prompt_encoding_is_the_tokenizers(checkpoint, llm, caplog):
    """Prompts as text get the ids get_tokenizer().encode gives (but a text that starts with BOS, which transformers
    doubles: docs/vllm_differences.md), and nothing warns that they differ."""
    with caplog.at_level(logging.WARNING, logger="kiln.tokenizer"):
        tok = load_tokenizer(checkpoint, vocab=MODEL_VOCAB).transformers_tokenizer
    assert _warnings(caplog) == []
    texts = [t for t in TEXTS if t and not (tok.bos_token and t.startswith(tok.bos_token))]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(t) for t in texts]


def test_a_llama2_tokenizer_json_gets_autotokenizers_class_and_a_warning(tmp_path, caplog):
    """Sentencepiece's prefix space as a normalizer (Llama 2's tokenizer.json): transformers 5's LlamaTokenizer
    rebuilds it as a pre-tokenizer, which adds no second space before " hello"; get_tokenizer() is that (vLLM's), and
    says that kiln's prompts follow tokenizer.json."""
    from tokenizers import Tokenizer

    save_legacy_llama(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kiln.tokenizer"):
        own = load_tokenizer(tmp_path, vocab=MODEL_VOCAB)
        tok = own.transformers_tokenizer
    hf = vllm_tokenizer(tmp_path)
    assert type(tok) is type(hf) is _class("LlamaTokenizerFast")
    assert_same_settings(tok, hf)
    assert_same_calls(tok, hf)
    assert_same_chat(tok, hf)
    (warning,) = _warnings(caplog)
    assert "LlamaTokenizer" in warning and "tokenizer.json" in warning and "llm.tokenizer.encode" in warning
    file = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = " hello world"
    assert own.encode(text, special=False) == file.encode(text, add_special_tokens=False).ids
    assert own.encode(text, special=False) != tok.encode(text, add_special_tokens=False)


def test_a_class_transformers_lacks_is_pretrained_tokenizer_fast(tmp_path):
    save_class_checkpoint("llama", tmp_path, tokenizer_class="NoSuchTokenizerFast")
    tok, hf = load_tokenizer(tmp_path, vocab=MODEL_VOCAB).transformers_tokenizer, vllm_tokenizer(tmp_path)
    assert type(tok) is type(hf) is transformers.PreTrainedTokenizerFast
    assert_same_settings(tok, hf)
    assert_same_calls(tok, hf)


def test_remote_code_falls_back_to_kilns_tokenizer_with_a_warning(tmp_path, caplog):
    """AutoTokenizer refuses a checkpoint whose tokenizer is remote code (vLLM's trust_remote_code defaults to
    False); get_tokenizer() is then PreTrainedTokenizerFast over kiln's tokenizer, encoding as it does."""
    save_class_checkpoint("llama", tmp_path, tokenizer_class="NoSuchTokenizer",
                          auto_map={"AutoTokenizer": ["tok.NoSuchTokenizer", None]})
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True, trust_remote_code=False)
    with caplog.at_level(logging.WARNING, logger="kiln.tokenizer"):
        own = load_tokenizer(tmp_path, vocab=MODEL_VOCAB)
        tok = own.transformers_tokenizer
    assert type(tok) is transformers.PreTrainedTokenizerFast
    (warning,) = _warnings(caplog)
    assert "cannot load" in warning and "PreTrainedTokenizerFast" in warning
    for text in TEXTS:
        assert tok.encode(text) == own.encode(text) or text.startswith(tok.bos_token)


def test_a_quantized_checkpoint_gives_its_sources_class(family, checkpoint, llm, tmp_path):
    """`kiln quantize` carries config.json with the tokenizer files: AutoTokenizer needs its model type where
    tokenizer_config.json names no class (GPT-2), or it gives a generic tokenizer without the special tokens."""
    from kiln import LLM
    from kiln.cli.commands import main

    out = tmp_path / "q"
    assert main(["quantize", str(checkpoint), "--quantize", "int8", "-o", str(out), "--device", "cpu"]) == 0
    tok, source = LLM(str(out), device="cpu", use_kernels=False).get_tokenizer(), llm.get_tokenizer()
    assert type(tok) is type(source) is _class(CLASS_NAMES[family])
    assert tok.special_tokens_map == source.special_tokens_map
    assert_same_calls(tok, source)
