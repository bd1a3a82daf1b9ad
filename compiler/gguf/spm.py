"""Sentencepiece vocabularies in GGUF files (tokenizer.ggml.model = llama: Llama 2, Mistral 7B v0.1, TinyLlama)
rebuilt as a `tokenizers` BPE the way transformers' GGUF loader rebuilds them, so ids and text agree with it.

A GGUF stores the pieces, their scores and types but usually no merges (a file that lists them is taken at its
word). Sentencepiece BPE joins the adjacent pair whose joined piece scores highest, so every split of a piece
into two pieces is a merge ranked by that piece's score (ties: the longer left part, then the longer right part,
then file order). Spaces are the U+2581 marker, prepended to the text (only at its start, not after a special
token, as transformers does) unless the file says add_space_prefix = false (honoured as llama.cpp does; the
transformers GGUF loader ignores it); characters outside the vocabulary fall back to their UTF-8 bytes as <0xNN>
pieces.
The decoder undoes both: marker -> space, byte pieces -> bytes, then the one leading space is dropped.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.gguf.config import GGUFError, field

SPACE = "\u2581"


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces of the vocabulary, best joined piece first."""
    index = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=True))  # a repeated piece keeps its first place and its last score
    found: list[tuple[str, str, float]] = []
    for piece, s in score.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        splits.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        found += [(left, right, s) for left, right in splits]
    # One stable sort, descending: equal keys keep the order above (file order, then the parts' ids).
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def spm_tokenizer(reader: Any, tokens: list[str], path: str | os.PathLike) -> Any:
    """The sentencepiece tokenizer (a tokenizers.Tokenizer) of a GGUF: tokens, scores or merges, unknown token,
    add_space_prefix. Special and added tokens are the caller's (they are the same for every kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = field(reader, "tokenizer.ggml.merges")
    if merges:  # a file that lists its merges is taken at its word, as transformers does
        merges = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = field(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            have = "none" if scores is None else f"{len(scores)}"
            raise GGUFError(f"{path}: the sentencepiece vocabulary has {len(tokens)} tokens but {have} scores "
                            "(tokenizer.ggml.scores) and no tokenizer.ggml.merges, which decide its merges; "
                            "re-convert the file with llama.cpp's convert_hf_to_gguf.py")
        merges = spm_merges(tokens, [float(s) for s in scores])
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    # unk_token: a character with no piece and no byte piece becomes <unk> (as llama.cpp does), not nothing.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok
