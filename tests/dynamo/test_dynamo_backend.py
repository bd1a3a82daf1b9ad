"""torch.compile(model, backend="kiln") against eager: tiny HF models (fp32, random weights), generated kernels
in Triton's interpreter on CPU; site counts, generate() with its recompilations, masks, options, entry point.

The default fallback is inductor, which on CPU compiles C++ (seconds per graph): the inductor path is checked on
one tiny model and an MLP here (tests/dynamo/test_inductor_fallback.py has the rest), every other test names
fallback="eager", which runs the same regions."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from kiln import env
from kiln.dynamo.backend import OPTIONS, STATS, parse_options
from kiln.errors import KilnError
from tests.support.dynamo_models import Unknown
from tests.support.hf_models import build_hf_model, prompts

EAGER = {"fallback": "eager"}

DECODER = {"attention": 2, "rms_norm": 5, "rope": 4, "gated_act": 2, "linear": 15, "add": 4}
# Two layers each. GPT-2's projections are Conv1D (addmm on a transposed weight), which kiln does not claim;
# its one claimed linear is the lm_head. "add" counts the residual adds that feed a norm (fused by norm_fusion).
EXPECTED = {
    "llama": DECODER,
    "mistral": DECODER,
    "qwen2": DECODER,
    "gpt2": {"attention": 2, "layer_norm": 5, "act": 2, "linear": 1, "add": 4},
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Dynamo caches graphs per code object, so two models of one class would share them; start clean.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("family", list(EXPECTED))
def test_hf_logits_match_eager_with_exact_claims(family, tmp_path):
    model, tokens = build_hf_model(family), prompts(length=10)
    first = len(STATS.reports)
    compiled = torch.compile(model, backend="kiln", options={**EAGER, "dump_dir": str(tmp_path)})
    with torch.no_grad():
        want, got = model(tokens).logits, compiled(tokens).logits
    assert close(got, want), (got - want).abs().max()
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == EXPECTED[family]
    assert not [r for r in report.rejections if r.pattern == "attention"]
    assert report.regions >= 1 and "flash_attn:attention" in report.kernels
    window = 4 if family == "mistral" else 0  # the sliding window is read off the mask and checked per call
    assert set(report.masks.values()) == {(True, window)}
    dumped = {p.name for p in (tmp_path / f"graph_{report.index}").iterdir()}
    assert {"00_dynamo.py", "01_normalized.py", "02_regions.py", "region_0"} <= dumped


def test_sdpa_attention_is_claimed():
    model, tokens = build_hf_model("qwen2"), prompts(length=9)
    model.set_attn_implementation("sdpa")  # is_causal=True, enable_gqa=True
    first = len(STATS.reports)
    with torch.no_grad():
        want, got = model(tokens).logits, torch.compile(model, backend="kiln", options=EAGER)(tokens).logits
    assert close(got, want)
    (report,) = STATS.reports[first:]
    # Under torch 2.13 transformers skips the mask (is_causal=True); under 2.11 dynamo sees it build one, which
    # kiln must then recognise as the causal mask (checked once per compile) and not leave the attention behind.
    assert report.counts()["attention"] == 2 and set(report.masks.values()) <= {(True, 0)}


def test_generate_same_tokens_bounded_recompiles():
    model, tokens = build_hf_model("llama"), prompts(length=6)
    with torch.no_grad():
        want = model.generate(tokens, max_new_tokens=20, do_sample=False)
        graphs, unique = STATS.graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model.forward = torch.compile(model.forward, backend="kiln", options=EAGER)
        got = model.generate(tokens, max_new_tokens=20, do_sample=False)
    compiled = STATS.graphs - graphs
    print(f"kiln compiled {compiled} graphs for 1 prefill + 19 decode steps")
    assert torch.equal(got, want)
    # prefill (static), first decode (static), then one graph with a symbolic cache length for every other step
    assert compiled == torch._dynamo.utils.counters["stats"]["unique_graphs"] - unique <= 3
    assert all(r.counts()["attention"] == 2 for r in STATS.reports[-compiled:])


def test_padding_fails_the_mask_guard_and_runs_the_original_graph():
    model, tokens = build_hf_model("llama"), prompts(length=8)
    ones = torch.ones_like(tokens)
    padded = ones.clone()
    padded[0, :3] = 0  # left padding: the mask is no longer causal
    compiled = torch.compile(model, backend="kiln", options=EAGER)
    with torch.no_grad():
        assert close(compiled(tokens, attention_mask=ones).logits, model(tokens, attention_mask=ones).logits)
        before = STATS.mask_fallbacks
        with pytest.warns(UserWarning, match="an attention mask failed its run-time check"):
            got, want = compiled(tokens, attention_mask=padded).logits, model(tokens, attention_mask=padded).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per graph, not on every such call
            compiled(tokens, attention_mask=padded)
    assert STATS.mask_fallbacks == before + 2
    assert close(got[1], want[1]) and close(got[0, 3:], want[0, 3:])


def test_unknown_module_runs_as_torch_and_claims_nothing():
    model, x = Unknown(), torch.randn(3, 5, 7)
    first = len(STATS.reports)
    got = torch.compile(model, backend="kiln", options=EAGER)(x)
    torch.testing.assert_close(got, model(x))
    (report,) = STATS.reports[first:]
    assert report.claims == [] and report.regions == 0
    assert {"cumsum", "flip", "amax", "mean"} <= {f.op for f in report.fallbacks}


class RmsMlp(torch.nn.Module):
    """An HF-style RMSNorm and a SwiGLU MLP around a residual."""

    def __init__(self, d: int = 16, f: int = 32):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))
        self.gate, self.up, self.down = torch.nn.Linear(d, f), torch.nn.Linear(d, f), torch.nn.Linear(f, d)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def test_inductor_is_the_default_fallback():
    model, x = RmsMlp(), torch.randn(2, 5, 16)
    first = len(STATS.reports)
    with torch.no_grad():
        got = torch.compile(model, backend="kiln")(x)
    assert close(got, model(x))
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == {"rms_norm": 1, "linear": 3, "gated_act": 1} and report.fallback == "inductor"


def test_unknown_options_are_an_error_naming_the_allowed_ones():
    with pytest.raises(KilnError, match="unknown option.*'mode_x'.*allowed: " + ", ".join(OPTIONS)):
        parse_options({"mode_x": 1})
    with pytest.raises(KilnError, match=r"option\(s\) 'fallbak' for backend 'kiln' \(did you mean 'fallback'\?\)"):
        parse_options({"fallbak": "eager"})
    with pytest.raises(KilnError, match="fallback='cuda'.*inductor, eager"):
        parse_options({"fallback": "cuda"})
    with pytest.raises(KilnError, match="mode='fast'.*default, reduce-overhead"):
        parse_options(None, mode="fast")
    with pytest.raises(KilnError, match="mode='reduce-overhead' with fallback='eager'.*use fallback='inductor'"):
        parse_options({"fallback": "eager", "mode": "reduce-overhead"})
    assert parse_options(None) == parse_options({"fallback": "inductor", "mode": "default"})
    assert parse_options(None, mode="reduce-overhead").mode == "reduce-overhead"
    with pytest.raises(Exception, match="allowed: claims, dump_dir, fallback"):
        torch.compile(Unknown(), backend="kiln", options={"bogus": True})(torch.randn(2, 7))


def test_claims_option_leaves_an_op_to_torch():
    model, tokens = build_hf_model("llama"), prompts(length=8)  # eager attention: a mask, checked per call if claimed
    first = len(STATS.reports)
    compiled = torch.compile(model, backend="kiln", options={**EAGER, "claims": {"attention": False, "rope": True}})
    with torch.no_grad():
        assert close(compiled(tokens).logits, model(tokens).logits)
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == {op: n for op, n in DECODER.items() if op != "attention"}
    assert [r.reason for r in report.rejections] == ["claims of attention are switched off (option claims)"] * 2
    assert report.masks == {}  # no mask check for an attention left to torch
    with pytest.raises(KilnError, match="option claims names unknown kiln op.*flash.*ops: attention, rms_norm"):
        parse_options({"claims": {"flash": False}})
    with pytest.raises(KilnError, match="option claims=.*expected a dict of kiln op -> True / False"):
        parse_options({"claims": ["attention"]})
    assert parse_options({"claims": {"linear": False, "add": True}}).off == {"linear"}


def test_entry_point_without_importing_kiln():
    code = (
        "import sys, torch\n"
        "assert 'kiln' in torch._dynamo.list_backends()\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())\n"
        "x = torch.randn(2, 3, 8)\n"
        "with torch.no_grad():\n"
        "    got = torch.compile(m, backend='kiln', options={'fallback': 'eager'})(x)\n"
        "    torch.testing.assert_close(got, m(x))\n"
        "from kiln.dynamo.backend import STATS\n"
        "print(dict(STATS.claims))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'linear': 1" in out.stdout and "'act': 1" in out.stdout


def test_changed_weights_are_frozen_anew_a_few_times_then_read_by_the_reference_ops():
    """A weight replaced through .data (same Parameter, same _version) or loaded in place (load_state_dict) is
    noticed and frozen into the region again, so the kernels keep running; a weight that keeps changing (a third
    time) sends the region to its reference ops, with a warning. Every result equals eager."""
    from kiln.dynamo import regions as regions_module

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)).eval()
    compiled = torch.compile(model, backend="kiln", options=EAGER)
    x = torch.randn(2, 3, 64)
    known = set(regions_module._REGIONS)
    with torch.no_grad():
        assert close(compiled(x), model(x))
        (region,) = [r for rid, r in regions_module._REGIONS.items() if rid not in known]
        model[0].weight.data = torch.randn(64, 64)  # the same Parameter object, at the same _version
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert close(compiled(x), model(x))
            model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})  # in place
            assert close(compiled(x), model(x))
        assert (region.refreezes, region.fallbacks) == (2, 0)
        model[2].bias.add_(1.0)
        with pytest.warns(UserWarning, match="a frozen weight changed again after 2 re-freezes"):
            assert close(compiled(x), model(x))
        assert close(compiled(x), model(x)) and (region.refreezes, region.fallbacks) == (2, 2)


def test_use_kernels_is_a_bool_and_needs_cuda_or_the_interpreter(monkeypatch):
    with pytest.raises(KilnError, match="option use_kernels=1; expected True, False or None"):
        parse_options({"use_kernels": 1})
    assert parse_options({"use_kernels": False}).use_kernels is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(env, "triton_interpret", lambda: False)
    with pytest.raises(KilnError, match=r"use_kernels=True needs CUDA or Triton's CPU interpreter \(TRITON_INTERPRET"):
        parse_options({"use_kernels": True})
    assert parse_options({"use_kernels": None}).use_kernels is None  # the default picks reference ops there


def test_passes_that_cannot_run_on_a_dynamo_graph_are_refused_up_front():
    with pytest.raises(KilnError, match="passes turns on kv_cache, which cannot run on a torch.compile graph"):
        parse_options({"passes": {"kv_cache": True}})
    with pytest.raises(KilnError, match="mod_routing.*passes for backend 'kiln': flash_tiling, gqa_fusion"):
        parse_options({"passes": {"mod_routing": True, "gqa_fusion": False}})
    assert parse_options({"passes": {"kv_cache": False, "flash_tiling": False}}).passes == {
        "kv_cache": False,
        "flash_tiling": False,
    }


class LayerNormGelu(torch.nn.Module):
    """LayerNorm and HF's gelu_new: under dynamic=True eps and math.pi reach the graph as float inputs."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)

    def forward(self, x):
        h = self.fc(self.norm(x))
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def test_layer_norm_and_tanh_gelu_are_claimed_under_dynamic_true():
    model, x = LayerNormGelu(), torch.randn(2, 5, 16)
    first = len(STATS.reports)
    with torch.no_grad():
        compiled = torch.compile(model, backend="kiln", dynamic=True, options=EAGER)
        assert close(compiled(x), model(x))
        y = torch.randn(2, 3, 16)
        assert close(compiled(y), model(y))  # another length: the same graph
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == {"layer_norm": 1, "linear": 1, "act": 1} and not report.rejections


def test_graphs_are_numbered_per_compile(tmp_path):
    for name in ("a", "b"):
        compiled = torch.compile(Unknown(), backend="kiln", options={**EAGER, "dump_dir": str(tmp_path / name)})
        compiled(torch.randn(3, 5, 7))
        assert STATS.reports[-1].index == 0
        assert [p.name for p in (tmp_path / name).iterdir()] == ["graph_0"]
