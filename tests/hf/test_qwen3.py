"""Qwen3 checkpoints (model_type "qwen3": per-head q/k RMSNorm, explicit head_dim, no biases by default) against
transformers' Qwen3ForCausalLM: config variants, weights, `kiln import` / `kiln run`, and a spec that leaves the q/k
norm out. The plain tiny Qwen3 runs with every other family in test_hf_oracle.py (logits and greedy tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.cli.commands import main
from kiln.errors import KilnError
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import build_graph
from kiln.model_config import AttentionCall
from kiln.reference import forward_logits, generate
from kiln.runtime.sampling_params import SamplingParams
from tests.support.hf_models import QWEN3_HEAD_DIM, assert_same_logits, edit_config, prompts, save_hf_model

NEW_TOKENS = 10


def _attention(d) -> AttentionCall:
    return next(s for s in config_from_hf(load_hf_config(d)).sites() if isinstance(s, AttentionCall))


def _hf_greedy(model, ids: list[int]) -> list[int]:
    row = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(row, attention_mask=torch.ones_like(row), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


VARIANTS = {  # name -> Qwen3Config overrides
    "gqa 4, head_dim 24": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24),
    "mha, head_dim 8 = dim / heads": dict(num_key_value_heads=4, head_dim=8),
    "attention_bias (q, k, v and o)": dict(attention_bias=True),
    "untied, 3 layers": dict(tie_word_embeddings=False, num_hidden_layers=3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_give_transformers_logits_and_greedy_tokens(tmp_path, variant):
    model = save_hf_model("qwen3", tmp_path, **VARIANTS[variant])
    attn = _attention(tmp_path)
    assert attn.qk_norm == "rms" and attn.qkv_bias == attn.out_bias == bool(VARIANTS[variant].get("attention_bias"))
    assert_same_logits(tmp_path)
    hf = load_hf_config(tmp_path)
    cfg = config_from_hf(hf)
    assert cfg.head_dim == VARIANTS[variant].get("head_dim", QWEN3_HEAD_DIM)
    gm = build_graph(cfg, load_hf_weights(tmp_path, cfg, model_type="qwen3"))
    ids = prompts(cfg.vocab, batch=1, length=9, seed=8)[0].tolist()
    want = _hf_greedy(model, ids)
    assert len(set(want)) >= 3, f"HF greedy output too repetitive to be a useful oracle: {want}"
    got = generate(gm, ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), context=cfg.context)
    assert got.token_ids == want


def test_q_and_k_norm_weights_load_from_their_own_tensors(tmp_path):
    model = save_hf_model("qwen3", tmp_path)
    cfg = config_from_hf(load_hf_config(tmp_path))
    weights = load_hf_weights(tmp_path, cfg, model_type="qwen3")
    for i in range(cfg.layers):
        attn = model.model.layers[i].self_attn
        assert torch.equal(weights[f"layers.{i}.attn0.q_norm.weight"], attn.q_norm.weight.detach())
        assert torch.equal(weights[f"layers.{i}.attn0.k_norm.weight"], attn.k_norm.weight.detach())
        assert not torch.equal(attn.q_norm.weight, attn.k_norm.weight)  # perturbed: a swap would show


def test_a_checkpoint_without_a_q_norm_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_model("qwen3", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = config_from_hf(load_hf_config(tmp_path))
    with pytest.raises(KilnError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_hf_weights(tmp_path, cfg, model_type="qwen3")


def test_an_absent_head_dim_is_the_config_class_default_128(tmp_path):
    """Qwen3Config has head_dim = 128, not hidden_size / heads (8 here) as llama-family configs derive it."""
    import transformers as tf

    save_hf_model("qwen3", tmp_path, head_dim=128)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert tf.AutoConfig.from_pretrained(tmp_path).head_dim == 128
    assert config_from_hf(load_hf_config(tmp_path)).head_dim == 128
    assert_same_logits(tmp_path)


def test_sliding_window_follows_use_sliding_window_as_in_qwen2(tmp_path):
    save_hf_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert _attention(tmp_path).window == 4
    assert_same_logits(tmp_path)  # 11 tokens: the window masks
    edit_config(tmp_path, use_sliding_window=False)  # transformers then drops the window
    assert _attention(tmp_path).window is None


def test_kiln_import_and_run_on_a_qwen3_checkpoint(tmp_path, capsys):
    model = save_hf_model("qwen3", tmp_path / "ckpt")
    spec = tmp_path / "q.kiln"
    assert main(["import", str(tmp_path / "ckpt"), "-o", str(spec), "--name", "tiny-q3"]) == 0
    text = spec.read_text()
    assert "qk_norm = rms" in text and f"head_dim = {QWEN3_HEAD_DIM}" in text and "qkv_bias" not in text
    assert main(["check", str(spec)]) == 0
    ids = prompts(batch=1, length=9, seed=6)[0].tolist()
    want = _hf_greedy(model, ids)
    for argv in (["run", "--weights", str(tmp_path / "ckpt")], ["run", str(spec), "--weights", str(tmp_path / "ckpt")]):
        capsys.readouterr()
        assert main([*argv, "--prompt-ids", ",".join(map(str, ids)), "--temperature", "0", "--max-tokens",
                     str(NEW_TOKENS), "--json"]) == 0
        assert json.loads(capsys.readouterr()[0])["token_ids"] == want


def test_a_spec_without_the_qk_norm_is_refused_for_a_qwen3_checkpoint(tmp_path, capsys):
    save_hf_model("qwen3", tmp_path / "ckpt")
    spec = tmp_path / "q.kiln"
    assert main(["import", str(tmp_path / "ckpt"), "-o", str(spec)]) == 0
    spec.write_text(spec.read_text().replace(", qk_norm = rms", ""))
    code = main(["run", str(spec), "--weights", str(tmp_path / "ckpt"), "--prompt-ids", "3,4", "--max-tokens", "1"])
    err = capsys.readouterr()[1]
    assert code == 2 and "attn0 qk_norm: none in the spec, rms in the checkpoint" in err, err


def test_the_qk_norm_is_what_makes_qwen3_logits(tmp_path):
    """The same weights without the q/k norm are far from transformers: the oracle above can fail."""
    import dataclasses

    save_hf_model("qwen3", tmp_path)
    cfg = config_from_hf(load_hf_config(tmp_path))
    weights = load_hf_weights(tmp_path, cfg, model_type="qwen3")
    body = tuple(dataclasses.replace(s, value=dataclasses.replace(s.value, right=dataclasses.replace(
        s.value.right, qk_norm=None))) if isinstance(s.value.right, AttentionCall) else s for s in cfg.body)
    plain = dataclasses.replace(cfg, body=body)
    kept = {k: v for k, v in weights.items() if not k.endswith((".q_norm.weight", ".k_norm.weight"))}
    ids = prompts(cfg.vocab, batch=1, length=9)
    a, b = forward_logits(build_graph(cfg, weights), ids), forward_logits(build_graph(plain, kept), ids)
    assert (a - b).abs().max() > 1e-2 * a.abs().max()
