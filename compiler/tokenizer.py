"""Tokenizers: a checkpoint's tokenizer.json through the `tokenizers` library, or a byte-level fallback.

The fallback lets a spec with random weights (or a checkpoint without tokenizer.json) still take text in
and give text out: UTF-8 bytes are the ids 0-255.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

from kiln.errors import KilnError
from kiln.step import TokenizerLike

_noted = False  # the fallback note is printed once per process


@runtime_checkable
class Tokenizer(TokenizerLike, Protocol):
    """A tokenizer kiln loads: what the runtime uses (kiln.step.TokenizerLike) and its vocabulary size."""

    vocab_size: int


class HFTokenizer:
    """A tokenizer.json loaded with the `tokenizers` library. Special tokens are not added on encode."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise KilnError(f"{path}: cannot load tokenizer ({e})") from None
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order (None for an id the vocabulary skips)."""
        return token_table(self._tok)


def token_table(tok) -> list[str | None]:
    """A `tokenizers.Tokenizer`'s token strings by id, added tokens included."""
    table: list[str | None] = [None] * tok.get_vocab_size(with_added_tokens=True)
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < len(table):
            table[i] = token
    return table


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; ids >= 256 (the rest of a bigger vocab) decode to nothing.

    A model with fewer than 256 ids can still run from --prompt-ids; only text that needs a byte id the
    vocab lacks is refused, when it is encoded.
    """

    def __init__(self, vocab: int, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size = vocab
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            raise KilnError(
                f"the byte-level tokenizer needs ids up to {max(ids)} for this text but the model's vocab is "
                f"{self.vocab_size}; give the checkpoint a tokenizer.json or pass --prompt-ids"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        try:
            data = bytes(ids)  # all of them bytes (the detokenizer's windows mostly are): no per-id Python filter
        except ValueError:
            data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order: `<0xNN>` for the bytes, None for the ids above them."""
        return [f"<0x{i:02X}>" if i < 256 else None for i in range(self.vocab_size)]


def _eos_value(path: Path):
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise KilnError(f"{path}: not valid JSON ({e}); fix or delete the file") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: holds a JSON {type(data).__name__}, not an object; fix or delete the file")
    return data.get("eos_token_id")


def eos_ids(hf_dir: str | Path) -> tuple[int, ...]:
    """eos_token_id from generation_config.json, else config.json (an int or a list); () when neither says."""
    for name in ("generation_config.json", "config.json"):
        path = Path(hf_dir) / name
        if not path.is_file():
            continue
        value = _eos_value(path)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if any(type(v) is not int or v < 0 for v in ids):
            raise KilnError(f"{path}: eos_token_id must be a token id (a whole number >= 0) or a list of them, "
                            f"got {value!r}; fix the value in the file")
        return tuple(ids)
    return ()


def load_tokenizer(hf_dir: str | Path | None, *, vocab: int) -> Tokenizer:
    """The checkpoint's tokenizer.json when there is one, else the byte-level tokenizer (with a note on stderr)."""
    global _noted
    if hf_dir is not None and (Path(hf_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(hf_dir) / "tokenizer.json", eos_ids(hf_dir))
    tok = ByteTokenizer(vocab, eos_ids(hf_dir) if hf_dir is not None else ())
    if not _noted:
        where = f"in {hf_dir}" if hf_dir is not None else "(no checkpoint)"
        print(f"kiln: no tokenizer.json {where}; using a byte-level tokenizer (ids 0-255)", file=sys.stderr)
        _noted = True
    return tok
