"""Tiny llama GGUFs with a made-up sentencepiece (tokenizer.ggml.model = llama) vocabulary, written with the gguf
package's own writer: byte-fallback <0xNN> tokens, control and user-defined tokens, and seeded scores that decide
which merges win; tensors F32 with q/k permuted as llama.cpp's converter permutes them."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.ir.frontend import random_weights
from kiln.model_config import ModelConfig
from tests.support.gguf_helper import _GGUF_NAMES, _permute, write_hparams

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
CHARS = list("abcdefghijklmnopqrstuvwxyzHTW0123456789,.!?'-é") + ["\u2581"]
PIECES = ["▁t", "he", "▁th", "▁the", "▁a", "in", "er", "on", "an", "re", "▁o", "▁w", "or", "ing", "▁in", "is",
          "▁is", "at", "en", "es", "ll", "▁he", "llo", "▁hello", "▁wor", "ld", "▁world", "wor", "orld", "12", "▁1",
          "▁▁", "▁▁▁▁", "▁▁▁", "ng", "th", "the", "▁an", "▁and", "nd", "ou", "▁you", "▁yo", "▁H", "▁He", "ello",
          "▁Hello", "▁W", "▁Wor", "▁World", "ed", "▁on", "▁one", "ne", "▁ot", "▁other", "her", "▁T", "▁The", "ay",
          "▁day", "▁d", "▁s", "▁st", "st", "ar", "▁star", "▁é", "té", "▁été", "!!", "..", "▁12", "123", "▁2", "'s"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # control tokens in the middle of the vocabulary, as chat models add them
USER = ["<tool>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def spm_vocab(seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types): <unk> <s> </s>, the 256 byte tokens, characters, merged pieces in a seeded
    order with seeded scores (so a longer piece can outrank its parts), control and user-defined tokens."""
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = PIECES[:]
    rng.shuffle(pieces)
    for p in pieces[:len(pieces) // 2] + SPECIALS + USER + pieces[len(pieces) // 2:]:
        tokens.append(p)
        types.append(CONTROL if p in SPECIALS else USER_DEFINED if p in USER else NORMAL)
        scores.append(0.0 if p in SPECIALS + USER else -round(rng.uniform(1, 60), 2))
    for c in CHARS:  # sentencepiece lists single characters last, with the lowest scores
        tokens.append(c)
        types.append(NORMAL)
        scores.append(-100.0 - len(tokens))
    return tokens, scores, types


def spm_config(vocab: int, **rope: Any) -> ModelConfig:
    from kiln.hf.config import config_from_hf

    hf = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          **({"rope_scaling": rope} if rope else {})}
    return config_from_hf(hf, name="tiny-spm")


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py writes it for a llama3-scaled model (per-pair divisors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_spm_gguf(path: Path, *, seed: int = 0, add_bos: bool | None = True, add_space_prefix: bool | None = None,
                   kind: str = "llama", score_sign: float = 1.0, scores: bool = True, merges: list[str] | None = None,
                   metadata: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None,
                   weight_scale: float = 3.0) -> dict[str, torch.Tensor]:
    """Write the tiny model; returns its weights in kiln's names and HF order. score_sign -1 reverses which merges
    win; scores=False leaves them out; merges are written as tokenizer.ggml.merges. metadata: extra key -> value;
    extra: extra F32 tensors (rope_freqs.weight)."""
    from gguf import GGUFWriter

    tokens, values, types = spm_vocab(seed)
    cfg = spm_config(len(tokens))
    weights = random_weights(cfg, seed=seed)
    # Sharper logits than N(0, 1/dim) weights give: greedy picks are then far from ties.
    weights = {k: (v * weight_scale if v.ndim == 2 else v) for k, v in weights.items()}
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny spm")
    write_hparams(w, cfg)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    if scores:
        w.add_token_scores([score_sign * v for v in values])
    if merges is not None:
        w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template(TEMPLATE)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value, _value_type(value))
    for name, t in extra.items() if extra else ():
        w.add_tensor(name, t.astype(np.float32))
    for name, t in weights.items():
        a = t.numpy()
        if name.endswith((".q.weight", ".k.weight")):
            a = _permute(a, cfg.heads if name.endswith(".q.weight") else cfg.kv_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _value_type(value: Any) -> Any:
    from gguf import GGUFValueType

    return {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
            str: GGUFValueType.STRING}[type(value)]


def _gguf_name(name: str) -> str:
    top = {"embed.weight": "token_embd.weight", "final_norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.weight"


def hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_model(path: Path, rope_parameters: dict | None = None) -> Any:
    """transformers' fp32 Llama with the GGUF's config and tensors (its own GGUF dequantizing and q/k un-permuting;
    without accelerate, so built from the config and loaded by hand); rope_parameters replaces the config's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if rope_parameters is not None:
        config = type(config)(**{**config.to_dict(), "rope_parameters": rope_parameters})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model
