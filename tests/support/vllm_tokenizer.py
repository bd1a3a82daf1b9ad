"""What vLLM's LLM.get_tokenizer() returns for a checkpoint directory or a GGUF (the oracle of the get_tokenizer()
tests): transformers' AutoTokenizer.from_pretrained, as vllm/tokenizers/hf.py (CachedHfTokenizer.from_pretrained)
calls it, with the truncation_side "left" vLLM gives a generating model's tokenizer (vllm/tokenizers/registry.py,
resolve_tokenizer_args); vLLM's get_cached_tokenizer subclass (cached special ids, vocabulary and length) aside."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def vllm_tokenizer(where: str | Path, **kwargs: Any) -> Any:
    """A checkpoint directory's tokenizer as vLLM loads it; a GGUF's with gguf_file=<its name> and its directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(where), local_files_only=True, truncation_side="left", **kwargs)


def vllm_gguf_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer as vLLM loads it (transformers' GGUF loader)."""
    return vllm_tokenizer(path.parent, gguf_file=path.name)
