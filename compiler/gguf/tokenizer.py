"""The tokenizer a GGUF file carries, rebuilt with the `tokenizers` library, and its chat template.

Byte-level BPE vocabularies (tokenizer.ggml.model = gpt2: SmolLM2, Llama 3, Qwen2) are rebuilt as transformers'
GGUF loader builds them: the token list as the BPE vocabulary (tokens outside the byte alphabet re-spelled in
it), the file's merges, GPT-2's byte-level pre-tokenizer (or the split regex the file's pre-tokenizer names) and
decoder, control tokens (type 3) as special tokens and user-defined ones (type 4) as added tokens. Decoding
skips special tokens. The chat template (tokenizer.chat_template) is rendered with jinja2 in a sandbox.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.gguf.config import GGUFError, field
from kiln.tokenizer import token_table

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with; others use GPT-2's own byte-level regex.
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
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


class GGUFTokenizer:
    """A GGUF's tokenizer: encode without adding special tokens, decode skipping them, and the chat template."""

    def __init__(self, tok: Any, eos_token_ids: tuple[int, ...], bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, path: str):
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order (what a draft model must share with its target)."""
        return token_table(self._tok)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered from the file's chat template."""
        if not self.chat_template:
            raise GGUFError(f"{self.path}: the file has no tokenizer.chat_template; drop --chat and write the "
                            "prompt in the model's own format")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise GGUFError(f"{self.path}: the chat template refused the conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise GGUFError(f"{self.path}: cannot render the chat template ({e}); drop --chat") from None


def load_gguf_tokenizer(reader: Any, path: str | os.PathLike) -> GGUFTokenizer:
    """The tokenizer in a GGUF's metadata; a file without one, or of a kind kiln cannot rebuild, is a GGUFError."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError(f"{path}: the file carries no tokenizer (tokenizer.ggml.tokens); use --prompt-ids, or a "
                        "GGUF converted with its tokenizer")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer kind {kind!r} is not supported yet; kiln rebuilds byte-level BPE "
                        "(tokenizer.ggml.model = gpt2) vocabularies; use the HF checkpoint's tokenizer.json instead")
    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{path}: the byte-level tokenizer has no tokenizer.ggml.merges; re-convert the file")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    split = SPLITS.get(field(reader, "tokenizer.ggml.pre") or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type") or []
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it, as we do.
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL and set(t) <= letters]
    tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    def token(key: str) -> tuple[int | None, str | None]:
        i = field(reader, f"tokenizer.ggml.{key}")
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)

    eos_id, eos = token("eos_token_id")
    eot_id, _ = token("eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos_id, eot_id) if i is not None))
    return GGUFTokenizer(tok, eos_ids, token("bos_token_id")[1], eos, field(reader, "tokenizer.chat_template"),
                         str(path))
