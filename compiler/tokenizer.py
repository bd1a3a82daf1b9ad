"""Tokenizers: a checkpoint's tokenizer.json through the `tokenizers` library, or a byte-level fallback.

The fallback lets a spec with random weights (or a checkpoint without tokenizer.json) still take text in
and give text out: UTF-8 bytes are the ids 0-255.

LLM.get_tokenizer() is transformers' tokenizer as AutoTokenizer loads it (TokenizerBase.transformers_tokenizer), as
vLLM's; the runtime, the server and the CLI use kiln's own, with kiln's defaults (decode skips special tokens).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kiln.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, special_token_texts
from kiln.errors import KilnError
from kiln.step import TokenizerLike

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("kiln.tokenizer")
_noted = False  # the fallback warning is given once per process


@runtime_checkable
class Tokenizer(TokenizerLike, Protocol):
    """A tokenizer kiln loads: what the runtime uses (kiln.step.TokenizerLike) and its vocabulary size."""

    vocab_size: int


class TokenizerBase:
    """What LLM.get_tokenizer() needs of kiln's tokenizers, and the transformers tokenizer made of it."""

    backend_tokenizer: Any = None  # the `tokenizers.Tokenizer` (transformers' name); the byte-level one has none
    checkpoint_dir: Path | None = None  # where transformers reads tokenizer_config.json and the rest, if anywhere

    def transformers_kwargs(self) -> dict[str, Any]:
        """The tokenizer's arguments that transformers does not read from its files itself."""
        return {}

    def transformers_source(self) -> tuple[str, dict[str, Any]] | None:
        """The directory AutoTokenizer.from_pretrained loads this tokenizer from, with its other arguments; None where
        it cannot (then transformers_tokenizer is PreTrainedTokenizerFast over this backend)."""
        return None if self.checkpoint_dir is None else (str(self.checkpoint_dir), {})

    @cached_property
    def transformers_tokenizer(self) -> PreTrainedTokenizerFast:
        """What vLLM's LLM.get_tokenizer() returns: AutoTokenizer.from_pretrained's tokenizer (of the class the
        checkpoint's tokenizer_config.json names, with that class's behaviour), reading its settings (special tokens,
        chat template, model_max_length, ...) from checkpoint_dir; a GGUF's, as transformers' GGUF loader gives it,
        over this backend; truncating on the left, as vLLM loads it. PreTrainedTokenizerFast over a copy of this
        backend where AutoTokenizer cannot load it (with a warning saying why). Made on first use; a KilnError
        without a backend (the byte-level fallback: nothing for transformers to wrap) or without transformers."""
        if self.backend_tokenizer is None:
            raise KilnError("LLM.get_tokenizer(): this model has no tokenizer.json, so kiln encodes text as UTF-8 "
                            "bytes (ids 0-255) and there is no transformers tokenizer to return; use llm.tokenizer "
                            "(encode, decode), or give the checkpoint its tokenizer.json")
        try:
            # lazy: transformers is optional (kiln[hf]) and slow to import; only get_tokenizer() needs it
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
        except ImportError:
            raise KilnError("LLM.get_tokenizer() returns transformers' tokenizer, as vLLM's does, and transformers "
                            "is not installed: `pip install transformers` (or kiln[hf]); kiln's own tokenizer, "
                            "which needs none, is llm.tokenizer") from None
        # vLLM loads a generating model's tokenizer with truncation_side "left" (a cut prompt keeps its end)
        kwargs = {"truncation_side": "left", **self.transformers_kwargs()}
        where, extra = str(self.checkpoint_dir or "the model's tokenizer"), {}
        try:
            # a GGUF's source builds the model type's config, which an older transformers may not know
            source = self.transformers_source()
            if source is not None:
                where, extra = source
                # transformers picks the class (tokenizer_config.json's tokenizer_class, the model type's, ...) as
                # vLLM's AutoTokenizer call does; remote code stays off, as vLLM's default trust_remote_code
                tok = AutoTokenizer.from_pretrained(where, local_files_only=True, trust_remote_code=False, **extra,
                                                    **kwargs)
        except Exception as e:  # transformers raises many kinds (ValueError, OSError, ImportError, ...)
            log.warning("get_tokenizer(): transformers' AutoTokenizer cannot load %s (%s: %s); returning "
                        "PreTrainedTokenizerFast over kiln's tokenizer instead", where, type(e).__name__, e)
        else:
            if source is not None:
                if "tokenizer_object" not in extra:  # its own backend, read from the files: may encode unlike ours
                    self._note_disagreement(tok, where)
                return tok
        kwargs = {"tokenizer_object": self.backend_tokenizer, **kwargs}
        if self.checkpoint_dir is None:
            return PreTrainedTokenizerFast(**kwargs)
        return PreTrainedTokenizerFast.from_pretrained(str(self.checkpoint_dir), local_files_only=True, **kwargs)

    def _note_disagreement(self, tok: Any, where: str) -> None:
        """A warning when transformers' tokenizer encodes a probe text unlike kiln's prompt encoding: a class that
        rebuilds its pipeline from tokenizer.json's vocabulary (transformers 5's LlamaTokenizer over a Llama-2
        tokenizer.json: leading spaces, text after a special token), or a special token only tokenizer_config.json
        names. get_tokenizer() stays vLLM's; kiln's prompts follow tokenizer.json (docs/vllm_differences.md)."""
        specials = [t for t in tok.all_special_tokens if t][:8]
        probes = [("hello world", True), (" hello  world\n\n x", False), ("e\u0301", False),
                  *((f"a{t} b", False) for t in specials)]
        for text, special in probes:
            ours = encode_text(self, text, special)  # type: ignore[arg-type]  (every subclass encodes)
            theirs = tok.encode(text, add_special_tokens=special)
            if ours != theirs:
                log.warning("get_tokenizer() is transformers' %s as AutoTokenizer loads %s (vLLM's), and it encodes "
                            "%r as %s where kiln's prompt encoding (tokenizer.json) gives %s; prompt_token_ids from "
                            "it are not what the same text as a prompt gets (llm.tokenizer.encode gives kiln's)",
                            type(tok).__name__, where, text, theirs, ours)
                return


class HFTokenizer(TokenizerBase):
    """A tokenizer.json loaded with the `tokenizers` library, and the checkpoint's chat template (None without
    one). encode adds the special tokens the file's post-processor adds (Llama's BOS; none for GPT-2 or Qwen2), as
    transformers' `tokenizer(text)` and vLLM do, except a leading one the text already starts with (a chat
    template that writes bos_token itself), which is not doubled."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise KilnError(f"{path}: cannot load tokenizer ({e})") from None
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._dir = self.checkpoint_dir = Path(path).parent
        self._prefix, self._suffix = _added_around(self._tok)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """tokenizer_config.json's chat template, read on first use (a broken one matters only to chat)."""
        return load_chat_template(self._dir)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return with_specials(ids, self._prefix, self._suffix) if special else ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered from the checkpoint's chat template."""
        if self.chat_template is None:
            raise ChatTemplateError("this checkpoint's tokenizer_config.json has no chat_template; write the prompt "
                                    "in the model's own format instead")
        return self.chat_template.render(messages, add_generation_prompt)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ids; special tokens add none unless skip_special_tokens is False (vLLM's option)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def added_tokens(self) -> dict[int, str]:
        """The added tokens (special ones included) by id, with their text."""
        return {int(i): t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def bos_token(self) -> str:
        """tokenizer_config.json's BOS text ("" without one): a chat template given in its place renders with it."""
        return special_token_texts(self._dir)[0]

    @cached_property
    def eos_token(self) -> str:
        return special_token_texts(self._dir)[1]

    @property
    def backend_tokenizer(self) -> Any:
        return self._tok

    def transformers_kwargs(self) -> dict[str, Any]:
        """Nothing when the checkpoint has tokenizer_config.json or special_tokens_map.json (transformers reads
        them); without either (a bare tokenizer.json beside save_pretrained's files), BOS, EOS and padding named by
        the ids in generation_config.json, else config.json, as kiln reads its EOS ids (transformers names none)."""
        if any((self._dir / name).is_file() for name in ("tokenizer_config.json", "special_tokens_map.json")):
            return {}
        ids = {"bos_token": config_token_ids(self._dir, "bos_token_id"), "eos_token": self.eos_token_ids,
               "pad_token": config_token_ids(self._dir, "pad_token_id")}
        return {name: text for name, found in ids.items() if found and (text := self._tok.id_to_token(found[0]))}

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order (None for an id the vocabulary skips)."""
        return token_table(self._tok)

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self._tok, token_id)


def encode_text(tokenizer: TokenizerLike, text: str, add_special: bool = True) -> list[int]:
    """text's token ids, with (add_special) or without the special tokens the tokenizer adds: vLLM's
    add_special_tokens, which a chat prompt takes False (the template writes BOS itself, so the ids are transformers'
    apply_chat_template(tokenize=True)). The one encoding of LLM.chat, `kiln run --chat` and the server. A tokenizer
    whose encode takes no `special` adds none (the byte-level one) and encodes as it does."""
    encode = tokenizer.encode
    if "special" in inspect.signature(encode).parameters:
        return encode(text, special=add_special)  # type: ignore[call-arg]
    return encode(text)


def with_specials(ids: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
    """ids between the special tokens a tokenizer adds, except a prefix the ids already start with (a chat
    template that writes bos_token itself), which is not doubled."""
    head = [] if prefix and ids[: len(prefix)] == prefix else prefix
    return [*head, *ids, *suffix]


def _added_around(tok) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's post-processor puts before and after a single sequence, read off a probe text (a
    post-processor is a fixed template, so one probe tells)."""
    probe = "a b"
    plain = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []  # a post-processor that rewrites the text's own ids: add nothing rather than guess


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_FROM_ALPHABET = {c: b for b, c in byte_alphabet().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tok, token_id: int) -> bytes:
    """The bytes one token adds to decoded text (OpenAI's logprobs `bytes`): its decoded text when that is whole
    UTF-8, else, for a token that holds part of a character, its raw bytes: a byte-level BPE token spelled in
    GPT-2's alphabet, or a sentencepiece byte-fallback token <0xNN>."""
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode("utf-8")
    raw = tok.id_to_token(token_id) or ""
    if m := _BYTE_TOKEN.fullmatch(raw):
        return bytes([int(m.group(1), 16)])
    if raw and all(c in _FROM_ALPHABET for c in raw):
        return bytes(_FROM_ALPHABET[c] for c in raw)
    return text.encode("utf-8")  # a token that really decodes to U+FFFD


def token_table(tok) -> list[str | None]:
    """A `tokenizers.Tokenizer`'s token strings by id, added tokens included."""
    table: list[str | None] = [None] * tok.get_vocab_size(with_added_tokens=True)
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < len(table):
            table[i] = token
    return table


class ByteTokenizer(TokenizerBase):
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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The UTF-8 text of the byte ids. It has no special tokens, so skip_special_tokens (taken as the other
        tokenizers take it) changes nothing: an id above 255 has no text either way."""
        try:
            data = bytes(ids)  # all of them bytes (the detokenizer's windows mostly are): no per-id Python filter
        except ValueError:
            data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order: `<0xNN>` for the bytes, None for the ids above them."""
        return [f"<0x{i:02X}>" if i < 256 else None for i in range(self.vocab_size)]


def read_json_object(path: Path, fix: str = "fix or delete the file") -> dict:
    """A checkpoint's JSON file that must hold an object (generation_config.json, ...), or a KilnError naming the
    file and `fix`."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise KilnError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def config_token_ids(hf_dir: str | Path, key: str) -> tuple[int, ...]:
    """`key` (eos_token_id, bos_token_id, pad_token_id) from generation_config.json, else config.json (an int or a
    list); () when neither says."""
    for name in ("generation_config.json", "config.json"):
        path = Path(hf_dir) / name
        if not path.is_file():
            continue
        value = read_json_object(path).get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if any(type(v) is not int or v < 0 for v in ids):
            raise KilnError(f"{path}: {key} must be a token id (a whole number >= 0) or a list of them, "
                            f"got {value!r}; fix the value in the file")
        return tuple(ids)
    return ()


def eos_ids(hf_dir: str | Path) -> tuple[int, ...]:
    """eos_token_id from generation_config.json, else config.json (an int or a list); () when neither says."""
    return config_token_ids(hf_dir, "eos_token_id")


def load_tokenizer(hf_dir: str | Path | None, *, vocab: int) -> Tokenizer:
    """The checkpoint's tokenizer.json when there is one, else the byte-level tokenizer, with a warning (the text
    in and out is not the model's own tokens)."""
    global _noted
    if hf_dir is not None and (Path(hf_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(hf_dir) / "tokenizer.json", eos_ids(hf_dir))
    tok = ByteTokenizer(vocab, eos_ids(hf_dir) if hf_dir is not None else ())
    if not _noted:
        where = f"in {hf_dir}" if hf_dir is not None else "(no checkpoint)"
        log.warning("no tokenizer.json %s; using a byte-level tokenizer (ids 0-255)", where)
        _noted = True
    return tok
