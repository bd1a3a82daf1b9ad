"""kiln.dynamo.explain: a printable report of what backend="kiln" claims in a model and what falls back, and why."""

from __future__ import annotations

import pytest
import torch

import kiln
from tests.dynamo.test_dynamo_backend import Unknown
from tests.support.hf_models import build_hf_model, prompts


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_explain_gpt2_lists_claims_refusals_and_fallbacks():
    report = kiln.explain(build_hf_model("gpt2"), prompts(length=7))
    assert isinstance(report, kiln.ExplainReport) and len(report.graphs) == 1
    assert dict(report.counts()) == {"attention": 2, "layer_norm": 5, "act": 2, "linear": 1, "add": 4}
    text = str(report)
    assert "kiln kernels claimed: act 2, add 4, attention 2, layer_norm 5, linear 1" in text
    assert "claimed   attention  transformer.h.0.attn" in text and "causal=True window=0" in text
    assert "claimed   act        transformer.h.1.mlp" in text and "gelu_tanh" in text
    assert "mask      %mask claimed as causal=True window=0, checked every call" in text
    assert "fallback  addmm x8 (transformer.h.0.attn.c_attn" in text and "no kiln pattern matches" in text


def test_explain_unknown_module_claims_nothing():
    report = kiln.explain(Unknown(), torch.randn(2, 3, 7), fallback="eager")
    assert not report.claimed and report.counts() == {}
    assert "kiln kernels claimed: nothing" in str(report) and "fallback  cumsum x1" in str(report)


def test_explain_rejects_unknown_options():
    with pytest.raises(Exception, match="allowed: dump_dir, fallback, passes, use_kernels"):
        kiln.explain(Unknown(), torch.randn(2, 3, 7), fallbak="eager")
