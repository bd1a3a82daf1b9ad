"""Incremental detokenization: the streamed text equals decoding all the tokens at once, for a byte-level BPE and a
sentencepiece-style (Metaspace) vocabulary trained here, with multi-byte characters split across tokens and special
tokens (no text) anywhere; and the decode window stays small when many tokens add no text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.runtime.detokenizer import MAX_PENDING, Detokenizer
from kiln.tokenizer import ByteTokenizer

TEXT = ("Once upon a time, in a city called Nova Haven, the towers glowed. Café, naïve, jalapeño — 東京 and 北京, "
        "emoji 🙂🚀 too. def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n") * 3


class Wrapped:
    """kiln's HF tokenizer interface over a `tokenizers` Tokenizer (special tokens skipped, as HFTokenizer does)."""

    eos_token_ids = ()

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.calls: list[int] = []

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        self.calls.append(len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _train(kind: str) -> Wrapped:
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # sentencepiece-style: words marked with U+2581, bytes for what the vocabulary lacks
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
        alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([TEXT[:200]], trainer)  # a small vocabulary: the rest of TEXT splits into bytes
    return Wrapped(tok)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_streamed_text_equals_the_whole_decode(kind):
    tok = _train(kind)
    special = tok.tok.token_to_id("</s>")
    rng = random.Random(0)
    for trial in range(20):
        start = rng.randrange(len(TEXT) // 2)
        ids = tok.encode(TEXT[start : start + rng.randint(1, 200)])
        for _ in range(rng.randint(0, 6)):  # special tokens decode to nothing, wherever they are
            ids.insert(rng.randint(0, len(ids)), special)
        d = Detokenizer(tok)
        streamed = []
        for t in ids:
            before = len(d.text)
            d.add(t)
            streamed.append(d.text[before:])
        d.flush()
        assert "".join(streamed) + d.text[len("".join(streamed)) :] == d.text
        assert d.text == tok.decode(ids), (kind, trial)


def test_tokens_without_text_do_not_grow_the_window():
    """kiln's byte-level fallback (random-weight models) decodes ids >= 256 to nothing: with a 128k vocabulary
    almost every token; each decode stays a few tokens long instead of everything since the last byte."""
    tok = ByteTokenizer(128256)
    calls = []
    decode = tok.decode
    tok.decode = lambda ids: calls.append(len(ids)) or decode(ids)
    rng = random.Random(1)
    d = Detokenizer(tok)
    ids = [rng.randrange(128256) for _ in range(2000)] + list(b"done")
    for t in ids:
        d.add(t)
    d.flush()
    # Random bytes are mostly broken UTF-8: the text is not the whole decode's, but every byte made it out.
    assert d.text.endswith("done") and len(d.text.encode()) >= sum(t < 256 for t in ids)
    assert max(calls) <= 2 * (MAX_PENDING + 1), max(calls)  # context + pending, never the whole run of no-text ids


def test_stop_strings_still_trim_with_the_new_window():
    tok = _train("bytelevel")
    ids = tok.encode("the towers glowed. Café")
    d = Detokenizer(tok, stop=["glowed"])
    found = None
    for t in ids:
        found = found or d.add(t)
    assert found == "glowed" and d.text == "the towers "


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_a_shared_one_token_cache_gives_the_same_text_with_fewer_decodes(kind):
    """Detokenizers of one engine share decode([id]) (Metaspace drops a lone token's leading space, so a cached
    text is only ever used as a one-token context, where it was decoded alone too)."""
    tok = _train(kind)
    rng = random.Random(2)
    streams = []
    for _ in range(12):
        start = rng.randrange(len(TEXT) // 2)
        streams.append(tok.encode(TEXT[start : start + rng.randint(1, 120)]))

    def run(cache: dict[int, str] | None) -> tuple[list[list[str]], int]:
        tok.calls.clear()
        dets = [Detokenizer(tok, (), cache) for _ in streams]
        deltas: list[list[str]] = [[] for _ in streams]
        for i in range(max(map(len, streams))):  # interleaved, as an engine's step adds one token to each
            for d, ids, out in zip(dets, streams, deltas, strict=True):
                if i < len(ids):
                    before = len(d.text)
                    d.add(ids[i])
                    out.append(d.text[before:])
        for d, out in zip(dets, deltas, strict=True):
            d.flush()
            out.append(d.text)
        return deltas, len(tok.calls)

    plain, plain_calls = run(None)
    cache: dict[int, str] = {}
    cached, cached_calls = run(cache)
    assert cached == plain and [out[-1] for out in plain] == [tok.tok.decode(ids) for ids in streams]
    assert cache and cached_calls < 0.85 * plain_calls, (cached_calls, plain_calls)
