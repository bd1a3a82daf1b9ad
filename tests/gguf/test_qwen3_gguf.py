"""Qwen3 GGUF files (architecture "qwen3": attn_q_norm / attn_k_norm tensors, head_dim from attention.key_length, q/k
not permuted), written with the gguf package: config, weights, logits against the stored weights and against
transformers' own GGUF loader, and serving through the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.gguf.config import config_from_gguf, open_gguf
from kiln.hf.config import config_from_hf
from kiln.ir.frontend import build_graph, random_weights
from kiln.model_config import AttentionCall, ModelConfig
from tests.support.gguf_helper import tokens, write_hparams, write_tokenizer

_NAMES = {"norm0.weight": "attn_norm", "norm1.weight": "ffn_norm", "attn0.q.weight": "attn_q",
          "attn0.k.weight": "attn_k", "attn0.v.weight": "attn_v", "attn0.o.weight": "attn_output",
          "attn0.q_norm.weight": "attn_q_norm", "attn0.k_norm.weight": "attn_k_norm", "mlp0.gate.weight": "ffn_gate",
          "mlp0.up.weight": "ffn_up", "mlp0.down.weight": "ffn_down"}


def qwen3_config(head_dim: int, heads: int = 4, kv_heads: int = 2) -> ModelConfig:
    hf = {"model_type": "qwen3", "vocab_size": len(tokens()), "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
          "intermediate_size": 128, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "tie_word_embeddings": True}
    return config_from_hf(hf, name="tiny-qwen3-gguf")


def write_qwen3_gguf(path: Path, cfg: ModelConfig, linear_type: str = "F32", seed: int = 0) -> dict:
    """A qwen3 GGUF of `cfg` as llama.cpp's converter lays it out; returns the weights it stores, in kiln's names."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    weights = random_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    writer = GGUFWriter(str(path), "qwen3")
    write_hparams(writer, cfg, rope_theta=1000000.0, eps=1e-6, key_length=True)  # head_dim is not dim / heads
    write_tokenizer(writer, pre="qwen2", bos=0)
    writer.add_add_bos_token(False)
    qtype = GGMLQuantizationType[linear_type]
    stored = {}
    for name, w in weights.items():
        if w.dim() == 1:  # norms: perturbed from 1 so a q_norm / k_norm mix-up shows
            w = w + 0.2 * torch.randn(w.shape, generator=g)
        arr = w.float().numpy()
        if name == "embed.weight":
            gname = "token_embd.weight"
        elif name == "final_norm.weight":
            gname = "output_norm.weight"
        else:
            _, layer, rest = name.split(".", 2)
            gname = f"blk.{layer}.{_NAMES[rest]}.weight"
        if arr.ndim == 1 or name == "embed.weight" or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gname, arr.astype(np.float32))
            stored[name] = torch.from_numpy(arr.copy())
        else:
            q = quantize(arr, qtype)
            writer.add_tensor(gname, q, raw_dtype=qtype)
            stored[name] = torch.from_numpy(np.ascontiguousarray(dequantize(q, qtype).reshape(arr.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    cfg = qwen3_config(head_dim=32)
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.Q8_0.gguf"
    return cfg, path, write_qwen3_gguf(path, cfg, "Q8_0")


def _load(path, quantize: str | None = None):
    from kiln.build import load_model

    return load_model(None, path, device="cpu", quantize=quantize)


def _logits(gm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return gm(torch.tensor([ids]), torch.arange(len(ids))[None]).float()


def test_config_from_metadata(q8):
    cfg, path, _ = q8
    got = config_from_gguf(open_gguf(path), path, name="tiny-qwen3-gguf")
    assert got == cfg and got.head_dim == 32 != got.dim // got.heads
    attn = next(s for s in got.sites() if isinstance(s, AttentionCall))
    assert attn.qk_norm == "rms" and not attn.qkv_bias


def test_dense_load_gives_the_stored_weights_logits(q8):
    cfg, path, stored = q8
    m = _load(path, quantize="none")
    for i in range(cfg.layers):
        for name in (f"layers.{i}.attn0.q_norm.weight", f"layers.{i}.attn0.k_norm.weight"):
            assert torch.equal(m.gm.get_parameter(name), stored[name])
    ids = [5, 80, 17, 200, 33, 9, 140]
    want = _logits(build_graph(cfg, stored), ids)
    torch.testing.assert_close(_logits(m.gm, ids), want, rtol=1e-5, atol=1e-5)


def test_kept_q8_0_serves_the_dense_models_greedy_tokens(q8):
    """The Q8_0 linears kept as kiln int8 (group 32) in the step graph, q/k norms on the way, through the engine."""
    from kiln.compile.step import compile_step
    from kiln.reference import generate
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    cfg, path, stored = q8
    m = _load(path, quantize="gguf")
    # gqa_fusion fused q/k/v through the q/k norms, then the kept blocks took the fused projections: qkv, o,
    # gate_up and down per layer
    assert sum(n.target == torch.ops.kiln.linear_w8.default for n in m.gm.graph.nodes) == 4 * cfg.layers
    prompt = [5, 80, 17, 200, 33, 9, 140, 61]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    want = generate(build_graph(cfg, stored), prompt, params, context=cfg.context).token_ids
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    engine = Engine(step, m.tokenizer, m.model)
    engine.add_request(prompt_token_ids=prompt, params=params)
    assert [o.outputs[0].token_ids for o in engine.run()] == [want]


def test_transformers_reads_the_same_model_from_the_file(tmp_path):
    """transformers' GGUF reader (config and tensor names, its own mapping) as an independent oracle. It takes
    head_dim from Qwen3Config's default (128), not from attention.key_length, so this file uses head_dim 128."""
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny-qwen3-hd128.gguf"
    write_qwen3_gguf(path, qwen3_config(head_dim=128, heads=2, kv_heads=1))
    hf_cfg = tf.AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    assert hf_cfg.model_type == "qwen3" and hf_cfg.head_dim == 128
    hf = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    assert "model.layers.1.self_attn.k_norm.weight" in tensors
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    hf.tie_weights()
    ids = [5, 80, 17, 200, 33, 9, 140, 61, 7]
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits
    got = _logits(_load(path, quantize="none").gm, ids)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
