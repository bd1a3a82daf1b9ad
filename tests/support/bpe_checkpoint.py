"""A tiny Hugging Face Llama checkpoint with a byte-level BPE tokenizer.json (tests/support/bpe_tokenizer.py), whose
token ids are not a text's UTF-8 bytes, and a spec for it with a compile block: for tests where what the model reads
(GPTQ calibration text, prompts) must go through the model's own tokenizer."""

from __future__ import annotations

from pathlib import Path

from tests.support.bpe_tokenizer import write_bpe
from tests.support.hf_models import save_hf_model

BPE_VOCAB = 300  # write_bpe's vocabulary: 3 specials, 256 byte symbols, merges up to id 299
# Words of write_bpe's corpus, so that merges (ids above the byte symbols') occur; under 128 tokens, one GPTQ row.
CALIBRATION_TEXT = "the quick brown fox jumps over the lazy dog; a kiln fires clay into pots. hello world\n" * 2


def save_bpe_checkpoint(d: Path) -> Path:
    """d holding a tiny random Llama (config.json, safetensors) and its BPE tokenizer.json; returns d."""
    save_hf_model("llama", d, vocab_size=BPE_VOCAB)
    write_bpe(d)
    return d


def write_spec(checkpoint: Path, path: Path, compile_block: str = "") -> Path:
    """The checkpoint's spec as `kiln import` writes it, with `compile_block`'s lines (e.g. `quantize = int8`) as its
    compile block; returns path."""
    from kiln.hf.config import config_from_hf, load_hf_config
    from kiln.hf.to_spec import config_to_spec
    from kiln.spec.formatter import format_spec

    cfg = config_from_hf(load_hf_config(checkpoint), name="bpe-llama")
    text = format_spec(config_to_spec(cfg))
    if compile_block:
        text += "\ncompile {\n  " + compile_block + "\n}\n"
    path.write_text(text)
    return path
