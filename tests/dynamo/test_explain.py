"""kiln.dynamo.explain: a printable report of what backend="kiln" claims in a model and what falls back, and why."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.dynamo.backend import STATS
from kiln.errors import KilnError
from tests.support.dynamo_models import Unknown
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
    with pytest.raises(KilnError, match="allowed: claims, dump_dir, fallback, mode, passes, use_kernels"):
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


def _rows(report, graph=0):
    return {row.part: row for row in report.timings[report.graphs[graph].index]}


def test_explain_timing_covers_every_region_the_rest_and_the_total(monkeypatch):
    """The numbers are not checked (CPU, a shared machine): that every region has a kiln time and an eager time
    of the torch nodes it replaced, that the rest and the total are there, and that the table prints them."""
    monkeypatch.setenv("KILN_DEBUG", "0")
    model = build_hf_model("llama")
    report = kiln.explain(model, prompts(length=6), timing=True, iters=2, baselines=("eager",), fallback="eager")
    (graph,) = report.graphs
    rows = _rows(report)
    assert set(rows) == {f"region {i}" for i in range(graph.regions)} | {"rest", "total", "mask checks"}
    assert all(r.kiln > 0 and r.eager is not None and r.eager > 0 and r.inductor is None for r in rows.values()
               if r.part != "mask checks")  # fmt: skip
    assert "attention" in rows["region 0"].what and rows["mask checks"].eager is None  # eager attention: a mask
    text = str(report)
    assert f"timing of graph {graph.index} (median ms" in text
    assert "part           kiln ms     eager ms     vs eager" in text
    for i in range(graph.regions):
        assert f"    region {i} " in text
    assert "    rest " in text and "    total " in text


class RmsMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(16))
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = x.to(torch.float32)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return torch.cumsum(x + self.down(torch.nn.functional.silu(self.up(h))), dim=-1)


def test_explain_timing_against_inductor():
    report = kiln.explain(RmsMlp(), torch.randn(2, 3, 16), timing=True, iters=1)  # fallback inductor, both baselines
    rows = _rows(report)
    assert set(rows) == {"region 0", "rest", "total"} and rows["region 0"].what == "rms_norm, linear x2, act"
    assert all(r.eager is not None and r.inductor is not None for r in rows.values())
    assert "vs inductor" in str(report)
    with pytest.raises(KilnError, match="baselines=.*subset of"):
        kiln.explain(RmsMlp(), torch.randn(2, 3, 16), timing=True, baselines=("tensorrt",))


class Masked(torch.nn.Module):
    """Keyword inputs, as HF models take them."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm = torch.nn.Embedding(32, 16), torch.nn.LayerNorm(16)

    def forward(self, input_ids, attention_mask=None):
        return self.norm(self.emb(input_ids)) * attention_mask[..., None]


def test_explain_takes_the_models_keyword_inputs():
    ids, am = torch.randint(0, 32, (2, 5)), torch.ones(2, 5)
    # options= and model keywords
    report = kiln.explain(Masked(), input_ids=ids, attention_mask=am, options={"fallback": "eager"})
    assert report.counts() == {"layer_norm": 1} and report.graphs[0].fallback == "eager"
    # the short form: keywords named like backend options are options, the rest the model's
    report = kiln.explain(Masked(), ids, attention_mask=am, fallback="eager", use_kernels=False)
    assert report.counts() == {"layer_norm": 1} and report.graphs[0].fallback == "eager"
    with pytest.raises(KilnError, match=r"'mask' is neither a backend option .* nor an input of the model"):
        kiln.explain(Masked(), ids, mask=am)


def test_explain_numbers_graphs_from_zero_in_every_call():
    for _ in range(2):
        text = str(kiln.explain(Masked(), torch.randint(0, 32, (2, 5)), torch.ones(2, 5), fallback="eager"))
        assert "\ngraph 0: 1 claim(s)" in text and "graph 1" not in text


def test_explain_fallbacks_are_tensor_compute_only():
    report = kiln.explain(build_hf_model("llama"), prompts(length=5), use_kernels=False, fallback="eager")
    ops = {f.op for g in report.graphs for f in g.fallbacks}
    # torch compute that kiln does not claim (the KV cache's cat with an empty tensor is a copy of k: glue)
    assert "embedding" in ops
    # host-side calls in Dynamo's graph: logging, tensors made from Python numbers, sizes, SymInt arithmetic
    assert not ops & {"_log_api_usage_once", "tensor", "numel", "le", "and_", "Size", "item", "arange"}, ops


def test_explain_leaves_the_users_recompile_budget_alone():
    """Dynamo counts recompiles per code object (HF's forward wrapper is one for every HF model): explain, whose
    backend never matches a graph already compiled, must not use them up, nor drop the user's compiled graphs."""
    model, ids, am = Masked(), torch.randint(0, 32, (2, 5)), torch.ones(2, 5)
    eager = {"fallback": "eager"}
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        users = torch.compile(model, backend="kiln", options=eager)
        users(ids, am)
        for _ in range(3):
            assert kiln.explain(model, ids, am, **eager).counts() == {"layer_norm": 1}
        graphs = STATS.graphs
        users(ids, am)  # still compiled
        assert STATS.graphs == graphs
        users(ids[:, :3], am[:, :3])  # another length: the one recompile the limit leaves the user
        assert STATS.graphs == graphs + 1
    assert "forward" not in model.__dict__  # explain's own copy of forward is gone


def test_explain_says_why_dynamo_compiled_nothing():
    with torch._dynamo.config.patch(recompile_limit=0):
        report = kiln.explain(Masked(), torch.randint(0, 32, (2, 5)), torch.ones(2, 5), fallback="eager")
    assert report.graphs == [] and report.limits
    lines = str(report).splitlines()
    assert lines[1].startswith("Dynamo compiled no graph, so kiln saw nothing: Dynamo hit config.recompile_limit (0)")


class AnyKeyword(Masked):
    """forward(**kwargs), as every HF model's."""

    def forward(self, input_ids, **kwargs):
        return super().forward(input_ids, kwargs["attention_mask"])


def test_explain_refuses_misspelt_options_for_a_model_taking_any_keyword():
    ids, am = torch.randint(0, 32, (2, 5)), torch.ones(2, 5)
    with pytest.raises(KilnError, match=r"'fallbak' is not an option \(did you mean 'fallback'\?\); 'use_kernel'"):
        kiln.explain(AnyKeyword(), ids, attention_mask=am, fallbak="eager", use_kernel=False)
    with pytest.raises(KilnError, match=r"'timng' is not an option \(did you mean 'timing'\?\)"):
        kiln.explain(build_hf_model("llama"), prompts(length=3), timng=True)
    # the model's own keywords, and any name not close to an option, still go to the model
    report = kiln.explain(AnyKeyword(), ids, attention_mask=am, use_cache=False, fallback="eager")
    assert report.counts() == {"layer_norm": 1}
