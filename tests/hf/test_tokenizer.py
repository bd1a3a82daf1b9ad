"""tokenizer.json through the `tokenizers` library, eos ids from the checkpoint, and the byte-level fallback."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

import kiln.tokenizer as tokmod
from kiln.errors import KilnError
from kiln.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from tests.support.bpe_tokenizer import write_bpe


def test_hf_tokenizer_round_trip_and_eos_from_generation_config(tmp_path):
    raw = write_bpe(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = load_tokenizer(tmp_path, vocab=300)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    text = "the lazy fox fires clay"
    ids = tok.encode(text)
    assert ids == raw.encode(text).ids and len(ids) < len(text)  # merges happened
    assert tok.decode(ids) == text
    assert tok.decode(ids + [2]) == text  # special tokens are skipped on decode
    assert tok.eos_token_ids == (2, 1)
    assert tok.vocab_size == raw.get_vocab_size()


def test_eos_from_config_json_and_none(tmp_path):
    write_bpe(tmp_path)
    assert load_tokenizer(tmp_path, vocab=300).eos_token_ids == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_tokenizer(tmp_path, vocab=300).eos_token_ids == (7,)


def test_word_level_tokenizer(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, vocab=3)
    assert tok.encode("hello world zebra") == [1, 2, 0]
    assert tok.vocab_size == 3


def test_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(KilnError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path, vocab=300)


def test_byte_fallback_and_one_time_note(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(tokmod, "_noted", False)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3]}))
    tok = load_tokenizer(tmp_path, vocab=512)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 512 and tok.eos_token_ids == (3,)
    # a warning of the kiln logger, which the CLI prints as `kiln: ...` (tests/cli/test_cli_status_lines.py)
    assert f"no tokenizer.json in {tmp_path}; using a byte-level tokenizer (ids 0-255)" in caplog.messages
    caplog.clear()
    load_tokenizer(None, vocab=256)
    assert caplog.messages == []  # once per process


def test_byte_tokenizer_codec():
    tok = ByteTokenizer(300)
    ids = tok.encode("héllo ✓")
    assert ids == list("héllo ✓".encode()) and max(ids) < 256
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([104, 105, 256, 299]) == "hi"  # ids past the byte range decode to nothing
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


def test_byte_tokenizer_with_a_small_vocab_refuses_only_text_it_cannot_encode():
    tok = load_tokenizer(None, vocab=100)
    assert tok.encode("0A") == [48, 65]  # bytes below 100 are fine
    assert tok.decode([104, 105]) == "hi"
    with pytest.raises(KilnError, match="needs ids up to 122 .* vocab is 100.*--prompt-ids"):
        tok.encode("z")


def test_special_tokens_as_the_post_processor_adds_them(tmp_path):
    """Llama-style tokenizer.json (a BOS template): ids as transformers' tokenizer(text) gives them; a prompt that
    already starts with BOS (a chat template that writes it) gets no second one; no post-processor adds nothing."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import processors

    raw = write_bpe(tmp_path)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    raw.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, vocab=300)
    for text in ("the lazy fox", "hello world", " a"):
        assert tok.encode(text) == hf(text).input_ids and tok.encode(text)[0] == bos
        assert tok.encode(text, special=False) == hf(text, add_special_tokens=False).input_ids
    assert tok.encode("<s>hello world") == hf("<s>hello world", add_special_tokens=False).input_ids
    assert tok.encode("<s>hello world").count(bos) == 1

    plain = tmp_path / "plain"
    plain.mkdir()
    write_bpe(plain)
    assert load_tokenizer(plain, vocab=300).encode("hello world") == RawTokenizer.from_file(
        str(plain / "tokenizer.json")).encode("hello world").ids
