"""kiln.dynamo.explain: a printable report of what backend="kiln" claims in a model and what falls back, and why."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.errors import KilnError
from tests.dynamo.test_dynamo_backend import Unknown
from tests.support.hf_models import build_hf_model, prompts


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_explain_gpt2_lists_claims_refusals_and_fallbacks():
    report = kiln.explain(build_hf_model("gpt2"), prompts(length=7), fallback="eager")
    assert isinstance(report, kiln.ExplainReport) and len(report.graphs) == 1
    assert dict(report.counts()) == {"attention": 2, "layer_norm": 5, "act": 2, "linear": 1, "add": 4}
    text = str(report)
    assert "kiln ops claimed: act 2, add 4, attention 2, layer_norm 5, linear 1; refused: nothing; kernels: " in text
    assert "claimed   attention  transformer.h.0.attn" in text and "causal=True window=0" in text
    assert "claimed   act        transformer.h.1.mlp" in text and "gelu_tanh" in text
    assert "mask      %mask claimed as causal=True window=0, checked every call" in text
    assert "fallback  addmm x8 (transformer.h.0.attn.c_attn" in text and "no kiln pattern matches" in text


def test_explain_unknown_module_claims_nothing():
    report = kiln.explain(Unknown(), torch.randn(2, 3, 7), fallback="eager")
    assert not report.claimed and report.counts() == {}
    text = str(report)
    assert "kiln ops claimed: nothing; refused: nothing; kernels: none" in text and "fallback  cumsum x1" in text


def test_explain_rejects_unknown_options():
    with pytest.raises(KilnError, match="allowed: dump_dir, fallback, mode, passes, use_kernels"):
        kiln.explain(Unknown(), torch.randn(2, 3, 7), fallbak="eager")
    with pytest.raises(KilnError, match="option passes='all'"):
        kiln.explain(Unknown(), torch.randn(2, 3, 7), passes="all")
    with pytest.raises(KilnError, match="generate=0"):
        kiln.explain(build_hf_model("llama"), prompts(length=3), generate=0)


def test_explain_header_says_reference_ops_when_no_kernels_run():
    report = kiln.explain(build_hf_model("gpt2"), prompts(length=5), use_kernels=False, fallback="eager")
    header, first = str(report).splitlines()[:2]
    assert "kiln ops claimed: act 2, add 4, attention 2" in header
    assert "kernels: none (claimed ops run as kiln reference ops" in header and "kernels: none;" in first


def test_explain_generate_covers_every_decode_graph(monkeypatch):
    monkeypatch.setenv("KILN_DEBUG", "0")
    model = build_hf_model("llama")
    model.set_attn_implementation("sdpa")
    forward = model.forward
    report = kiln.explain(model, prompts(length=4), generate=3, use_kernels=False, fallback="eager")
    assert model.forward == forward  # restored
    # prefill, the first decode step, then the decode graph with a symbolic key length: all claim attention
    assert len(report.graphs) == 3 and all(g.counts()["attention"] == 2 for g in report.graphs)
    assert report.refusals() == {} and "refused: nothing" in str(report)
    assert str(report).count("claimed   attention  model.layers.0.self_attn") == 3
