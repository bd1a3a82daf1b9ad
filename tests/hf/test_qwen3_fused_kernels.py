"""A Qwen3 checkpoint compiled with the model pipeline onto the generated kernels (the interpreter on CPU) gives
transformers' logits: its q/k norms and ropes run as one kiln::qk_norm_rope launch per layer (rope_fusion)."""

from __future__ import annotations

import pytest
import torch

from kiln.compile.driver import compile_model
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import build_graph
from kiln.model_config import CompileConfig
from tests.support.hf_models import PROMPT_LEN, hf_logits, prompts, save_hf_model

VARIANTS = {  # name -> Qwen3Config overrides (norm weights perturbed by save_hf_model, q's and k's apart)
    "gqa 2, head_dim 16": {},
    "gqa 3, head_dim 24, odd q heads": dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_kernels_give_transformers_logits(tmp_path, variant):
    save_hf_model("qwen3", tmp_path, **VARIANTS[variant])
    hf = load_hf_config(tmp_path)
    cfg = config_from_hf(hf)
    gm = build_graph(cfg, load_hf_weights(tmp_path, cfg, model_type="qwen3"))
    compiled = compile_model(gm, CompileConfig(), use_kernels=True)
    assert "rope_fusion" in compiled.passes
    launched = [r.params.get("op") for r in compiled.kernels]
    assert "qk_norm_rope" in launched and "head_rms_norm" not in launched and "rope" not in launched
    ids = prompts(cfg.vocab, batch=2, length=PROMPT_LEN)
    with torch.no_grad():
        got = compiled(ids, torch.arange(PROMPT_LEN).expand(2, PROMPT_LEN).contiguous())
    want = hf_logits(tmp_path, ids)
    err = (got - want).abs().max().item()
    assert err < 1e-4 * want.abs().max().item(), err
