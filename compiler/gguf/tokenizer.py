"""The tokenizer a GGUF file carries, rebuilt with the `tokenizers` library, and its chat template.

Byte-level BPE vocabularies (tokenizer.ggml.model = gpt2: SmolLM2, Llama 3, Qwen2) are rebuilt as transformers'
GGUF loader builds them: the token list as the BPE vocabulary (tokens outside the byte alphabet re-spelled in
it), the file's merges, GPT-2's byte-level pre-tokenizer (or the split regex the file's pre-tokenizer names) and
decoder. Sentencepiece vocabularies (tokenizer.ggml.model = llama: Llama 2, Mistral 7B v0.1) are rebuilt by
kiln.gguf.spm. Either way control tokens (type 3) are special tokens and user-defined ones (type 4) added tokens;
decoding skips special tokens unless asked to keep them (skip_special_tokens=False) and encoding adds BOS / EOS where
the file asks for them. The chat template
(tokenizer.chat_template) is rendered by kiln.chat_template, as a checkpoint's is.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from kiln.chat_template import ChatTemplate
from kiln.gguf.config import ARCHITECTURES, GGUFError, field
from kiln.gguf.spm import spm_tokenizer
from kiln.tokenizer import TokenizerBase, byte_alphabet, token_bytes, token_table, with_specials

CONTROL, USER_DEFINED = 3, 4
# tokenizer.ggml.model -> what kiln rebuilds it as (others, like bert or rwkv, are refused by name).
KINDS = {"gpt2": "byte-level BPE (gpt2)", "llama": "sentencepiece (llama)"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with; others use GPT-2's own byte-level regex.
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


class GGUFTokenizer(TokenizerBase):
    """A GGUF's tokenizer: encode adding BOS / EOS as the file says (tokenizer.ggml.add_bos_token / add_eos_token,
    as llama.cpp and transformers do), decode skipping special tokens (or keeping them), and the chat template.
    unk_token / pad_token: the file's unknown and padding tokens (transformers' named special tokens); model_type: the
    Hugging Face model type of the file's architecture (what LLM.get_tokenizer()'s class follows)."""

    def __init__(self, tok: Any, eos_token_ids: tuple[int, ...], bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, path: str, *, kind: str = "gpt2", bos_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, unk_token: str | None = None,
                 pad_token: str | None = None, model_type: str | None = None):
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self._chat_source = chat_template
        self.path = path
        self.kind = kind
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and bool(eos_token_ids)
        self.unk_token, self.pad_token = unk_token, pad_token
        self.model_type = model_type

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text`; special=True adds the file's BOS / EOS, except a BOS the text already starts with
        (a chat template that writes bos_token itself), which is not doubled."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if not special:
            return ids
        bos, eos = [self.bos_id] if self.add_bos else [], [self.eos_token_ids[0]] if self.add_eos else []
        return with_specials(ids, bos, eos)

    @property
    def backend_tokenizer(self) -> Any:
        return self._tok

    def transformers_kwargs(self) -> dict[str, Any]:
        """What transformers' GGUF loader reads from the file besides the vocabulary: the BOS, EOS, unknown and
        padding tokens (None where the file names none, as the loader passes them: a class's own defaults, like
        Qwen2Tokenizer's <|endoftext|>, do not apply), whether encoding adds BOS / EOS (transformers then writes the
        post-processor), the chat template."""
        return {"bos_token": self.bos_token or None, "eos_token": self.eos_token or None,
                "unk_token": self.unk_token or None, "pad_token": self.pad_token or None, "add_bos_token": self.add_bos,
                "add_eos_token": self.add_eos, "chat_template": self._chat_source}

    def transformers_source(self) -> tuple[str, dict[str, Any]] | None:
        """The file's directory for AutoTokenizer, with the config of the file's model type, so that transformers
        picks the class as its GGUF loader does (Qwen2Tokenizer for qwen2 and qwen3, TokenizersBackend for llama; a
        tokenizer_config.json beside the file counts, as there), over this backend (the vocabulary rebuilt as the
        loader rebuilds it). The loader itself would read the file again (seconds for a 49k vocabulary); None for an
        architecture kiln does not map to a model type."""
        if self.model_type is None:
            return None
        # lazy: transformers is optional and slow to import; only get_tokenizer() asks
        from transformers import AutoConfig

        path = Path(self.path)
        return str(path.parent), {"config": AutoConfig.for_model(self.model_type), "tokenizer_object": self._tok}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ids; control tokens (and sentencepiece's unknown / BOS / EOS / padding pieces) add none unless
        skip_special_tokens is False (vLLM's option and /detokenize's), as transformers decodes the file."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def added_tokens(self) -> dict[int, str]:
        """The added tokens (special and user-defined ones) by id, with their text."""
        return {int(i): t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def token_strings(self) -> list[str | None]:
        """Every id's token string, in id order (what a draft model must share with its target)."""
        return token_table(self._tok)

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self._tok, token_id)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The file's chat template, parsed on first use (a broken one matters only to chat)."""
        if not self._chat_source:
            return None
        return ChatTemplate(self._chat_source, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                            origin=f"{self.path} (tokenizer.chat_template)")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered from the file's chat template."""
        if self.chat_template is None:
            raise GGUFError(f"{self.path}: the file has no tokenizer.chat_template; write the prompt in the model's "
                            "own format instead")
        return self.chat_template.render(messages, add_generation_prompt)

    def save_checkpoint_files(self, out_dir: str | os.PathLike) -> None:
        """Write this tokenizer as a Hugging Face checkpoint's files (tokenizer.json, tokenizer_config.json with
        the chat template, generation_config.json with the EOS ids, config.json with the model type), which
        kiln.tokenizer.load_tokenizer reads back as the same tokenizer: a `kiln quantize` output of a GGUF needs no
        GGUF to decode text."""
        from tokenizers import Tokenizer, processors

        tok = Tokenizer.from_str(self._tok.to_str())  # a copy: the post-processor below is only for the file
        # HFTokenizer adds what the post-processor adds; the GGUF's add_bos / add_eos say the same as a template.
        bos = [self._tok.id_to_token(self.bos_id)] if self.add_bos else []
        eos = [self._tok.id_to_token(self.eos_token_ids[0])] if self.add_eos else []
        if bos or eos:
            ids = [*([self.bos_id] if bos else []), *(self.eos_token_ids[:1] if eos else [])]
            tok.post_processor = processors.TemplateProcessing(
                single=" ".join([*bos, "$A", *eos]), pair=" ".join([*bos, "$A", *eos, "$B"]),
                special_tokens=list(zip(bos + eos, ids, strict=True)))
        out = Path(out_dir)
        tok.save(str(out / "tokenizer.json"))
        # A token the file lacks is written as null, not left out: a tokenizer class's own default (Qwen2Tokenizer's
        # <|endoftext|>) must not fill it in, as transformers' GGUF loader passes None for it
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token or None,
                  "pad_token": self.pad_token or None}
        if self._chat_source:
            config["chat_template"] = self._chat_source
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.eos_token_ids:
            (out / "generation_config.json").write_text(
                json.dumps({"eos_token_id": list(self.eos_token_ids)}, indent=2) + "\n")
        if self.model_type is not None:  # AutoTokenizer (get_tokenizer()) takes the class from it, as from the GGUF
            (out / "config.json").write_text(json.dumps({"model_type": self.model_type}, indent=2) + "\n")


def load_gguf_tokenizer(reader: Any, path: str | os.PathLike) -> GGUFTokenizer:
    """The tokenizer in a GGUF's metadata; a file without one, or of a kind kiln cannot rebuild, is a GGUFError."""
    from tokenizers import AddedToken

    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError(f"{path}: the file carries no tokenizer (tokenizer.ggml.tokens); use --prompt-ids, or a "
                        "GGUF converted with its tokenizer")
    if kind not in KINDS:
        raise GGUFError(f"{path}: tokenizer kind {kind!r} (tokenizer.ggml.model) is not supported; kiln rebuilds "
                        f"{' and '.join(KINDS.values())} vocabularies; use the HF checkpoint (--weights DIR, with its "
                        "tokenizer.json) or pass --prompt-ids")
    types = field(reader, "tokenizer.ggml.token_type") or []

    def token(key: str) -> tuple[int | None, str | None]:
        i = field(reader, f"tokenizer.ggml.{key}")
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)

    if kind == "gpt2":
        tok, letters = _byte_level(reader, tokens, path)
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it, as we do.
        special = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL and set(t) <= letters]
        vocab = tok.get_vocab()
    else:
        tok = spm_tokenizer(reader, tokens, path)
        # transformers makes the unknown, BOS, EOS and padding pieces special too (<unk> is type UNKNOWN, not CONTROL).
        named = {token(k)[1] for k in ("unknown_token_id", "bos_token_id", "eos_token_id", "padding_token_id")}
        special = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL or t in named]
        vocab = {t: i for i, t in enumerate(tokens)}
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    # User-defined tokens (type 4, like <think>) are matched whole in the text, as llama.cpp does, but not special.
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    bos_id, bos = token("bos_token_id")
    eos_id, eos = token("eos_token_id")
    eot_id, _ = token("eot_token_id")
    _, unk = token("unknown_token_id")
    _, pad = token("padding_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos_id, eot_id) if i is not None))
    # A sentencepiece file that does not say gets BOS, as llama.cpp and transformers give it.
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    return GGUFTokenizer(tok, eos_ids, bos, eos, field(reader, "tokenizer.chat_template"), str(path), kind=kind,
                         bos_id=bos_id, add_bos=add_bos, add_eos=add_eos, unk_token=unk, pad_token=pad,
                         model_type=ARCHITECTURES.get(field(reader, "general.architecture") or ""))


def _byte_level(reader: Any, tokens: list[str], path: str | os.PathLike) -> tuple[Any, set[str]]:
    """The byte-level BPE of a gpt2-kind vocabulary, and its byte alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{path}: the byte-level tokenizer has no tokenizer.ggml.merges; re-convert the file")
    alphabet = byte_alphabet()
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
    return tok, letters
