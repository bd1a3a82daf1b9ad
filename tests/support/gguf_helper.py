"""Tiny GGUF files written with the gguf package's own writer: a 2-layer llama with a byte-level BPE vocabulary,
q/k permuted the way llama.cpp's converter permutes them, linears as Q4_1 (or Q4_0 / F32), norms F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.ir.frontend import random_weights
from kiln.model_config import ModelConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "o n", "Ġ a", "e r", "a n", "Ġ o", "r e"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    from kiln.tokenizer import byte_alphabet

    return list(byte_alphabet().values())


def tokens() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + byte_tokens() + merged


def tiny_config() -> ModelConfig:
    from kiln.hf.config import config_from_hf

    hf = {"model_type": "llama", "vocab_size": len(tokens()), "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    return config_from_hf(hf, name="tiny-gguf")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (rotate-half order -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"norm0.weight": "attn_norm", "norm1.weight": "ffn_norm", "attn0.q.weight": "attn_q",
               "attn0.k.weight": "attn_k", "attn0.v.weight": "attn_v", "attn0.o.weight": "attn_output",
               "mlp0.gate.weight": "ffn_gate", "mlp0.up.weight": "ffn_up", "mlp0.down.weight": "ffn_down"}


def write_hparams(writer, cfg, *, rope_theta: float = 10000.0, eps: float = 1e-5, key_length: bool = False) -> None:
    """A llama-family ModelConfig's hyperparameters as GGUF metadata. key_length: write head_dim as the key and value
    lengths too, as llama.cpp's converter does where head_dim is not dim / heads (Qwen3)."""
    writer.add_block_count(cfg.layers)
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.ffn)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    if key_length:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(cfg.head_dim)


def write_tokenizer(writer, *, pre: str, bos: int) -> None:
    """The tiny byte-level BPE tokenizer (tokens(), MERGES, eos 2) and TEMPLATE as GGUF metadata."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    toks = tokens()
    writer.add_token_list(toks)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(toks) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)


def write_tiny_gguf(path: Path, *, linear_type: str = "Q4_1", arch: str = "llama", seed: int = 0) -> dict:
    """Write the tiny model; returns its weights in kiln's names and HF order (what the GGUF stores, dequantized)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    cfg = tiny_config()
    weights = {k: v.float().numpy() for k, v in random_weights(cfg, seed=seed).items()}
    qtype = GGMLQuantizationType[linear_type]
    writer = GGUFWriter(str(path), arch)
    write_hparams(writer, cfg)
    write_tokenizer(writer, pre="default", bos=1)
    stored = {}
    for name, w in weights.items():
        if name == "embed.weight":
            gname = "token_embd.weight"
        elif name == "final_norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.split(".", 2)[1], name.split(".", 2)[2]
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}.weight"
        if w.ndim == 1 or name == "embed.weight":
            writer.add_tensor(gname, w.astype(np.float32))
            stored[name] = torch.from_numpy(w.copy())
            continue
        if arch == "llama" and name.endswith((".q.weight", ".k.weight")):
            heads = cfg.heads if name.endswith(".q.weight") else cfg.kv_heads
            w_file = _permute(w, heads)
        else:
            heads, w_file = None, w
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gname, w_file.astype(np.float32))
            deq = w_file.astype(np.float32)
        else:
            q = quantize(w_file.astype(np.float32), qtype)
            writer.add_tensor(gname, q, raw_dtype=qtype)
            deq = dequantize(q, qtype).reshape(w.shape)
        if heads:  # back to HF order: the tensor kiln must end up with
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        stored[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def tiny_gguf_and_text(d: Path) -> tuple[Path, Path]:
    """A tiny Q4_1 GGUF and a short text file in `d`: what the perplexity tests score."""
    path, text = d / "tiny.Q4_1.gguf", d / "text.txt"
    write_tiny_gguf(path)
    text.write_text("the other one in the north, then another one over the river. " * 6)
    return path, text
