"""Tiny Hugging Face checkpoints built offline with transformers: fp32, random weights, saved to a directory.

The init is much larger than HF's default (0.02) so that logits are far from uniform and greedy decoding
wanders over many tokens instead of repeating one, which makes the oracle comparisons meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import build_graph
from kiln.reference import forward_logits

INIT = 0.3
VOCAB = 288  # >= 256 so the byte-level tokenizer fallback works with these checkpoints too
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    initializer_range=INIT,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MISTRAL_WINDOW = 4
QWEN3_HEAD_DIM = 16  # explicit, and not hidden_size / heads (8), as in the real Qwen3 checkpoints
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def _config(family: str, **overrides):
    import transformers as tf

    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return tf.LlamaConfig(**{**SMALL, "rope_parameters": rope, **overrides})
    if family == "mistral":
        return tf.MistralConfig(**{**SMALL, "sliding_window": MISTRAL_WINDOW, **overrides})
    if family == "qwen2":
        return tf.Qwen2Config(**{**SMALL, "tie_word_embeddings": True, **overrides})
    if family == "qwen3":  # q_norm / k_norm over each head; no q/k/v biases by default
        return tf.Qwen3Config(**{**SMALL, "head_dim": QWEN3_HEAD_DIM, "tie_word_embeddings": True, **overrides})
    if family == "gpt2":
        base = dict(
            n_embd=32,
            n_head=4,
            n_layer=2,
            vocab_size=VOCAB,
            n_positions=64,
            initializer_range=INIT,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return tf.GPT2Config(**{**base, **overrides})
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random HF causal LM (eval mode, fp32, eager attention) of the given family."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # norms init to exactly 1 / 0; perturb them so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf_model(family: str, path: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Build a tiny model and save it (config.json, safetensors) under `path`; returns the model."""
    model = build_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def prompts(vocab: int = VOCAB, batch: int = 2, length: int = 10, seed: int = 1) -> torch.Tensor:
    """A [batch, length] batch of token ids avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


PROMPT_LEN = 11  # longer than MISTRAL_WINDOW, so a wrong window changes the logits


def edit_config(d: Path, **changes) -> None:
    path = d / "config.json"
    hf = json.loads(path.read_text())
    hf.update(changes)
    path.write_text(json.dumps(hf))


def hf_logits(d: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def kiln_logits(d: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = load_hf_config(d)
    cfg = config_from_hf(hf)
    return forward_logits(build_graph(cfg, load_hf_weights(d, cfg, model_type=hf["model_type"])), ids)


def assert_same_logits(d: Path) -> None:
    ids = prompts(batch=2, length=PROMPT_LEN)
    want, got = hf_logits(d, ids), kiln_logits(d, ids)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 1e-4 * want.abs().max().item(), err
