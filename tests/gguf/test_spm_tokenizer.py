"""Sentencepiece GGUFs (tokenizer.ggml.model = llama): kiln's rebuilt tokenizer against transformers' on the same
file (ids with BOS, ids without, decoded text), the flags the file carries, and the model through `kiln run`
against transformers' greedy ids."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.gguf.config import GGUFError, open_gguf
from kiln.gguf.tokenizer import load_gguf_tokenizer
from tests.support.spm_files import hf_model, hf_tokenizer, spm_vocab, write_spm_gguf

TEXTS = ["hello world", " hello", "  two  spaces  ", "Hello World!! The day, the star.", "a\nb\n\nc",
         "\n leading newline", "the other one <|im_end|>there", "<|im_start|>user\nhi<|im_end|>\n",
         "x<tool>y <tool> z", "🦙 été 日本語 ünï", "12345 123 wor orld world1234", "tab\there", "", " ",
         "\u2581 marker itself", "</s> after eos"]


def _kiln(path):
    return load_gguf_tokenizer(open_gguf(path), path)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    write_spm_gguf(path)
    return path, _kiln(path), hf_tokenizer(path)


def _same(kiln_tok, hf_tok, texts=TEXTS):
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert kiln_tok.encode(text) == ids, text
        assert kiln_tok.encode(text, special=False) == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert kiln_tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text


def test_ids_and_text_equal_transformers(spm):
    path, tok, hf_tok = spm
    _same(tok, hf_tok)
    ids = tok.encode("🦙 the other one <|im_end|>")
    pieces = [tok._tok.id_to_token(i) for i in ids]
    assert pieces[:3] == ["<s>", "\u2581", "<0xF0>"]  # BOS, the marker, then the emoji's bytes (byte fallback)
    assert "<|im_end|>" in pieces and tok.decode(ids) == "🦙 the other one "
    assert tok.vocab_size == len(spm_vocab()[0]) and tok.eos_token_ids == (2,) and tok.kind == "llama"


def test_scores_decide_the_merges(spm, tmp_path):
    """The same pieces with the scores reversed tokenize differently, and still as transformers does."""
    path, tok, _ = spm
    flipped = tmp_path / "flipped.gguf"
    write_spm_gguf(flipped, score_sign=-1.0)
    other = _kiln(flipped)
    _same(other, hf_tokenizer(flipped))
    differ = [t for t in TEXTS if tok.encode(t) != other.encode(t)]
    assert len(differ) >= 5, differ


def test_a_chat_template_that_writes_bos_gets_one(spm):
    _, tok, hf_tok = spm
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages)
    assert text.startswith("<s><|im_start|>user\n")
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.encode(text) == list(want) and want[:2] != [1, 1]  # not doubled by encode's own BOS


def test_add_bos_false_is_honoured(tmp_path):
    path = tmp_path / "nobos.gguf"
    write_spm_gguf(path, add_bos=False)
    tok, hf_tok = _kiln(path), hf_tokenizer(path)
    assert not tok.add_bos and tok.encode("hello")[0] != 1
    _same(tok, hf_tok)


def test_add_space_prefix_false_is_honoured(spm, tmp_path):
    """transformers' GGUF loader ignores the flag (it always prepends); llama.cpp honours it, and so does kiln:
    compared with transformers' own Llama tokenizer built with add_prefix_space=False on the same pieces."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    path = tmp_path / "nospace.gguf"
    write_spm_gguf(path, add_space_prefix=False)
    tok = _kiln(path)
    tokens, scores, _ = spm_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    hf_tok = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, dict(zip(tokens, scores, strict=True))),
                            add_prefix_space=False, add_bos_token=True)
    plain = [t for t in TEXTS if "<" not in t]  # the hand-built tokenizer has no control / user-defined tokens
    _same(tok, hf_tok, plain)
    assert tok.encode("hello") != spm[1].encode("hello")  # the prefixed file starts it with the marker
    assert tok.decode(tok.encode(" hello")) == " hello"


@pytest.mark.parametrize("kind", ["bert", "rwkv"])
def test_unsupported_kinds_are_refused_by_name(tmp_path, capsys, kind):
    from kiln.cli import main

    path = tmp_path / f"{kind}.gguf"
    write_spm_gguf(path, kind=kind)
    with pytest.raises(GGUFError, match=f"tokenizer kind '{kind}'"):
        _kiln(path)
    assert main(["run", "--weights", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("kiln: error:") == 1 and str(path) in err and f"'{kind}'" in err
    assert "sentencepiece (llama)" in err and "--prompt-ids" in err


def test_a_vocabulary_without_scores_or_merges_is_refused(tmp_path):
    path = tmp_path / "noscores.gguf"
    write_spm_gguf(path, scores=False)
    with pytest.raises(GGUFError, match=r"noscores.gguf: .* but none scores .*tokenizer.ggml.scores"):
        _kiln(path)


def test_merges_in_the_file_are_used_as_given(spm, tmp_path):
    """A sentencepiece file that lists merges (here: the score-derived ones, reversed) is tokenized by them."""
    from kiln.gguf.spm import spm_merges

    tokens, scores, _ = spm_vocab()
    path = tmp_path / "merges.gguf"
    write_spm_gguf(path, merges=[f"{a} {b}" for a, b in reversed(spm_merges(tokens, scores))])
    tok = _kiln(path)
    _same(tok, hf_tokenizer(path))
    assert [t for t in TEXTS if tok.encode(t) != spm[1].encode(t)]


def test_kiln_run_gives_transformers_greedy_ids(spm, capsys):
    """`kiln run --weights FILE.gguf` (prompt encoded with BOS, fp32, the engine) against transformers' generate
    on its own tokenizer's ids and its own dequantized tensors."""
    from kiln.cli import main

    path, _, hf_tok = spm
    prompt, new = "hello world, the day", 8
    assert main(["run", "--weights", str(path), "--prompt", prompt, "--max-tokens", str(new), "--temperature", "0",
                 "--json", "--dtype", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = hf_tok(prompt)["input_ids"]
    assert out["prompt_token_ids"] == ids and ids[0] == 1
    model = hf_model(path)
    with torch.no_grad():
        got = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    assert out["token_ids"] == got[:len(out["token_ids"])] and len(out["token_ids"]) >= 4
    assert out["text"] == hf_tok.decode(out["token_ids"], skip_special_tokens=True)
