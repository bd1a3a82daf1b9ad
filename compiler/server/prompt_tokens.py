"""A request's prompt as token ids (_tokens: tokenized, truncated, length-checked), and the tokenizer calls the
routes share: _encode (with or without the special tokens), _decode_all (/detokenize), _prompt_text (echo)."""

from __future__ import annotations

import inspect

from kiln.errors import KilnError
from kiln.runtime.engine import Engine
from kiln.server.protocol import APIError
from kiln.tokenizer import encode_text


def _prompt_text(engine: Engine, prompt: str | list[int], ids: list[int]) -> str:
    """What echo puts before the text: the prompt as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if engine.tokenizer is None:
        raise APIError(400, "echo of a prompt given as token ids needs the model's tokenizer to give its text, and "
                       "this model has none; omit echo (prompt_logprobs gives the prompt's logprobs)", param="echo")
    return engine.tokenizer.decode(ids)


def _encode(engine: Engine, text: str, add_special: bool, param: str, what: str = "text") -> list[int]:
    """The text's token ids, with (add_special) or without the special tokens the tokenizer adds, as LLM.chat and
    `kiln run --chat` encode (kiln.tokenizer.encode_text). A text the tokenizer refuses (a KilnError: the byte-level
    tokenizer's byte beyond the vocabulary) is a 400 naming `param`; any other failure is a bug, left to surface as
    a 500 with its traceback logged. (Lone surrogates, which the `tokenizers` library refuses, are a 400 already
    when the request is read.)"""
    try:
        return encode_text(engine.tokenizer, text, add_special)
    except KilnError as e:
        raise APIError(400, f"the {what} cannot be tokenized: {e}", param=param) from None


def _decode_all(engine: Engine, ids: list[int]) -> str:
    """/detokenize's text: special tokens' text kept, as vLLM's (transformers' decode default); a tokenizer whose
    decode takes no such choice decodes as it does."""
    decode = engine.tokenizer.decode
    if "skip_special_tokens" in inspect.signature(decode).parameters:
        return decode(ids, skip_special_tokens=False)
    return decode(ids)


def _tokens(engine: Engine, prompt: str | list[int], limit: int, param: str = "prompt", *,
            add_special: bool = True, keep: int | None = None) -> list[int]:
    """The prompt's token ids; `param` names the field it came from in errors (chat: "messages"). add_special: a
    text gets the special tokens the tokenizer adds (vLLM's add_special_tokens); keep: only the last `keep` tokens
    (truncate_prompt_tokens), before the length is checked."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompt as token ids", param=param)
        ids = _encode(engine, prompt, add_special, param, what="prompt")
    else:
        ids = list(prompt)
    if keep is not None and len(ids) > keep:
        ids = ids[len(ids) - keep:]
    if not ids:
        raise APIError(400, "the prompt is empty; give at least one token", param=param)
    if len(ids) > limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens, over the limit of {limit} (the model's context or "
                       f"--max-prompt-tokens); shorten {'the messages' if param == 'messages' else 'it'}",
                       param=param, code="context_length_exceeded")
    return ids
