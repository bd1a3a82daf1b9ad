"""backend="kiln" on the paths real use takes, with KILN_DEBUG off: debug re-propagates shapes after every pass
and so hid a region that reached flash_tiling without meta["val"]. HF generate() with sdpa and eager attention,
batch size changes (1 -> 3 -> 2) under automatic, dynamic=True and static shapes, decode attention over a
variable key length, backward (inference only) and the backend's option errors."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import kiln.compile.pipeline
import kiln.env
from kiln.dynamo.backend import STATS, parse_options
from kiln.errors import KilnError
from tests.support.hf_models import build_hf_model, prompts

NEW_TOKENS = 3
EAGER = {"fallback": "eager"}  # the same regions, no C++ compile (inductor: tests/dynamo/test_inductor_fallback.py)
DECODER = {"attention": 2, "rms_norm": 5, "rope": 4, "gated_act": 2, "linear": 15, "add": 4}


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.setenv("KILN_DEBUG", "0")
    assert not kiln.env.debug()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class ProjectedAttention(torch.nn.Module):
    """q projected in the graph, k and v from outside: a region (linear, attention) that no pass before
    flash_tiling changes."""

    def __init__(self, heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False)

    def forward(self, x, k, v):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, t, -1)


def test_untouched_region_reaches_flash_tiling_with_shapes():
    model, x = ProjectedAttention(), torch.randn(2, 3, 16)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    first = len(STATS.reports)
    with torch.no_grad():
        got = torch.compile(model, backend="kiln", options=EAGER)(x, k, v)
    torch.testing.assert_close(got, model(x, k, v), atol=1e-5, rtol=1e-4)
    (report,) = STATS.reports[first:]
    assert report.counts()["attention"] == 1 and "flash_attn:attention" in report.kernels


def test_separate_key_and_value_lengths_are_claimed_equal_behind_a_guard():
    # k's and v's lengths (and batches) marked dynamic get their own symbols, as in a KV cache's decode graph
    model = ProjectedAttention()
    compiled = torch.compile(model, backend="kiln", options=EAGER)
    first = len(STATS.reports)
    for b, s in ((2, 5), (3, 7), (4, 6)):
        x, k, v = torch.randn(b, 1, 16), torch.randn(b, 2, s, 8), torch.randn(b, 2, s, 8)
        for t in (x, k, v):
            torch._dynamo.mark_dynamic(t, 0)
        for t in (k, v):
            torch._dynamo.mark_dynamic(t, 2)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, k, v), model(x, k, v), atol=1e-5, rtol=1e-4)
    # One graph serves every call: the guards kiln adds (v's length == k's, equal batches) hold whenever sdpa
    # accepts the inputs.
    (report,) = STATS.reports[first:]
    assert report.counts()["attention"] == 1 and report.rejections == []


def test_run_pipeline_fills_missing_shapes_before_the_first_pass():
    def attend(q, k, v):  # q computed in the graph: flash_tiling reads the shape of a non-input node
        return torch.ops.kiln.attention.default(torch.ops.kiln.add.default(q, q), k, v, 2, 1, True, 0, 0.25)

    gm = torch.fx.symbolic_trace(attend)
    for n, shape in zip(gm.graph.nodes, ((1, 3, 16), (1, 5, 8), (1, 5, 8)), strict=False):
        n.meta["val"] = torch.empty(shape)  # inputs only, as a graph built by hand would have them
    gm = kiln.compile.pipeline.run_pipeline(gm, [kiln.compile.pipeline.known_passes()["flash_tiling"]], debug=False)
    flash = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert flash.target == torch.ops.kiln.flash_attention.default and flash.meta["val"].shape == (1, 3, 16)


def _generate(model, tokens):
    return model.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize(
    ("family", "attn", "dynamic"),
    [("llama", "sdpa", None), ("qwen2", "sdpa", True), ("mistral", "eager", None), ("llama", "eager", False)],
)
def test_generate_batch_changes_equal_eager(family, attn, dynamic):
    model = build_hf_model(family)
    model.set_attn_implementation(attn)
    eager, compiled = model.forward, torch.compile(model.forward, backend="kiln", dynamic=dynamic, options=EAGER)
    first = len(STATS.reports)
    for batch in (1, 3, 2):
        tokens = prompts(batch=batch, length=4, seed=batch)
        with torch.no_grad():
            model.forward = eager
            want = _generate(model, tokens)
            model.forward = compiled
            got = _generate(model, tokens)
        assert torch.equal(got, want), (family, attn, dynamic, batch)
    # Every graph (prefill, decode steps over a variable key length, batch-symbolic recompiles) claims the whole
    # decoder; under dynamic=True too, where Dynamo passes eps and the attention scale as .item() inputs.
    reports = STATS.reports[first:]
    assert reports and all(dict(r.counts()) == DECODER for r in reports), [dict(r.counts()) for r in reports]
    assert not [r for g in reports for r in g.rejections]


def test_backward_is_a_kiln_error_naming_inference():
    model, tokens = build_hf_model("llama"), prompts(batch=1, length=4)
    out = torch.compile(model, backend="kiln", options=EAGER)(tokens).logits  # the forward works with gradients on
    with pytest.raises(KilnError, match="kiln's backend is for inference; use torch.no_grad"):
        out.sum().backward()


def test_backward_with_inductor_fallback_runs_forward_then_refuses():
    model, x = ProjectedAttention(), torch.randn(1, 3, 16)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.warns(UserWarning, match="runs without inductor: gradients are enabled"):
        out = torch.compile(model, backend="kiln", options={"fallback": "inductor"})(x, k, v)
    torch.testing.assert_close(out, model(x, k, v), atol=1e-5, rtol=1e-4)
    with pytest.raises(KilnError, match="for inference"):
        out.sum().backward()


def test_passes_option_is_validated():
    for bad in ("all", ["flash_tiling"], {"flash_tiling": "yes"}):
        with pytest.raises(KilnError, match="option passes=.*expected a dict of pass name -> True / False"):
            parse_options({"passes": bad})
    with pytest.raises(KilnError, match="unknown pass.*flashy.*known passes: .*flash_tiling"):
        parse_options({"passes": {"flashy": False}})
    assert parse_options({"passes": {"flash_tiling": False}}).passes == {"flash_tiling": False}


def test_dump_dir_option_is_validated(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(KilnError, match="option dump_dir=.*a_file.*not a writable directory"):
        parse_options({"dump_dir": str(blocker / "sub")})
    with pytest.raises(KilnError, match="option dump_dir=3.*expected a directory path"):
        parse_options({"dump_dir": 3})
    with pytest.raises(KilnError, match="options=.*expected a dict"):
        parse_options("fallback=eager")  # type: ignore[arg-type]
    assert parse_options({"dump_dir": tmp_path / "d"}).dump_dir == str(tmp_path / "d")


class GradInside(torch.nn.Module):
    """A forward that turns gradients on itself (an energy model's forces, dE/dx, are computed this way), so
    called under no_grad it still records an autograd graph: Dynamo's graph holds _set_grad_enabled(True)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        with torch.enable_grad():
            return self.b(torch.nn.functional.silu(self.a(x)))


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_gradients_switched_on_inside_the_graph_are_refused_not_lost(fallback):
    """Compiled under no_grad, such a graph still needs the regions' backward: a KilnError names it, where the
    inference op once let backward run and leave every .grad None (or drop the kiln regions' terms of dE/dx)."""
    model, x = GradInside(), torch.randn(4, 16)
    compiled = torch.compile(model, backend="kiln", options={"fallback": fallback})
    warned = pytest.warns(UserWarning, match="runs without inductor") if fallback == "inductor" else nullcontext()
    with torch.no_grad(), warned:
        out = compiled(x)
    assert out.requires_grad and torch.allclose(out, model(x), atol=1e-5)
    with pytest.raises(KilnError, match="for inference"):
        out.pow(2).sum().backward()


def test_weights_made_under_inference_mode_are_read_live():
    """Inference tensors have no version counter to freeze weights by: they stay inputs of the region, read on every
    call, so an in-place change under inference_mode is seen."""
    before = STATS.regions
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32)).eval()
        x = torch.randn(4, 32)
        compiled = torch.compile(model, backend="kiln", options=EAGER)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
        model[0].weight.mul_(2)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert STATS.regions > before  # kiln's regions ran, not a fallback of the whole graph
