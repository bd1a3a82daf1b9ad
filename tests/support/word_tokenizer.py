"""A tiny tokenizer.json for server and API tests: words w0 .. w9 (ids 0-9) and the special <s> (id BOS = 10) that its
post-processor puts first, as Llama's tokenizer adds BOS."""

from __future__ import annotations

from pathlib import Path

BOS = 10


def write_word_tokenizer(directory: Path) -> Path:
    """Write the tokenizer.json into `directory`; returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>"])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    path = directory / "tokenizer.json"
    raw.save(str(path))
    return path
