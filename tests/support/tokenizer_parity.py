"""LLM.get_tokenizer() (a transformers tokenizer kiln builds over its own `tokenizers` backend) against the one
vLLM would return for the same files (transformers' AutoTokenizer), call by call: the same arguments give equal
results (BatchEncodings as dicts, tensors by value)."""

from __future__ import annotations

from typing import Any

import torch

TEXTS = ["the quick brown fox", " hello world", "hello  world\n\nthe end", "", " ", "a", "<s>the lazy dog</s>",
         "héllo wörld 🦙 日本", "kiln fires clay into pots<unk>", "<|im_start|>user\nhi<|im_end|>\n",
         "x<tool>y <tool> z"]
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the quick fox"}, {"role": "user", "content": "into pots"}]
SETTINGS = ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
            "pad_token_id", "special_tokens_map", "all_special_tokens", "all_special_ids", "vocab_size",
            "model_max_length", "padding_side", "chat_template", "clean_up_tokenization_spaces")


def same(ours: Any, theirs: Any) -> bool:
    """Equal results: mappings key by key, tensors by value and dtype, the rest with ==."""
    if hasattr(theirs, "keys"):
        return set(ours.keys()) == set(theirs.keys()) and all(same(ours[k], theirs[k]) for k in theirs.keys())
    if isinstance(theirs, torch.Tensor):
        return isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    return type(ours) is type(theirs) and ours == theirs


def check(ours: Any, theirs: Any, call: str, *args: Any, **kwargs: Any) -> None:
    got, want = getattr(ours, call)(*args, **kwargs), getattr(theirs, call)(*args, **kwargs)
    assert same(got, want), f"{call}{args}{kwargs}: get_tokenizer() {got!r} != AutoTokenizer {want!r}"


def assert_same_settings(ours: Any, hf: Any, names: tuple[str, ...] = SETTINGS) -> None:
    """The special tokens and their ids, the vocabulary, and the settings a call falls back on."""
    for name in names:
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()


def assert_same_calls(ours: Any, hf: Any, texts: list[str] = TEXTS) -> None:
    """encode with and without special tokens; decode of ids with special tokens among them, kept and skipped;
    tokenizer(batch) padded, truncated and as tensors."""
    specials = [i for i in hf.all_special_ids if i is not None]
    for text in texts:
        for add in (True, False):
            check(ours, hf, "encode", text, add_special_tokens=add)
        ids = specials + hf.encode(text) + specials[::-1]
        check(ours, hf, "decode", ids)
        check(ours, hf, "decode", ids, skip_special_tokens=True)
        check(ours, hf, "convert_ids_to_tokens", ids)
    check(ours, hf, "__call__", texts)
    check(ours, hf, "__call__", texts, truncation=True, max_length=4)
    check(ours, hf, "batch_decode", [hf.encode(t) for t in texts], skip_special_tokens=True)
    if hf.pad_token is not None:
        check(ours, hf, "__call__", texts, padding=True, return_tensors="pt")
        check(ours, hf, "__call__", texts, padding="max_length", truncation=True, max_length=6, return_tensors="pt")


def assert_same_chat(ours: Any, hf: Any, conversation: list[dict] = CONVERSATION) -> None:
    """apply_chat_template with transformers' defaults (tokenize=True), as text, with the generation prompt, and a
    padded batch of conversations as tensors."""
    check(ours, hf, "apply_chat_template", conversation)
    for add in (False, True):
        check(ours, hf, "apply_chat_template", conversation, tokenize=False, add_generation_prompt=add)
        check(ours, hf, "apply_chat_template", conversation, tokenize=True, add_generation_prompt=add)
    if hf.pad_token is not None:
        batch = [conversation, conversation[:2]]
        check(ours, hf, "apply_chat_template", batch, padding=True, return_tensors="pt", return_dict=True)
