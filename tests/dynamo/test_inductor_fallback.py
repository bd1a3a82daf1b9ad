"""backend="kiln" with its default fallback, inductor: the unclaimed part compiled by inductor with the kiln regions
inside the same graph (no graph break), their call path free of host syncs (what CUDA graphs need), and
mode="reduce-overhead" on a GPU. Inductor compiles C++ on CPU, seconds per graph: one tiny model per test."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.dynamo import regions
from kiln.dynamo.backend import STATS
from kiln.errors import KilnError
from tests.support.hf_models import build_hf_model, prompts

DECODER = {"attention": 2, "rms_norm": 5, "rope": 4, "gated_act": 2, "linear": 15, "add": 4}


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.setenv("KILN_DEBUG", "0")  # debug re-propagates shapes after every pass: not the path users take
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _sdpa_llama():
    model = build_hf_model("llama")
    model.set_attn_implementation("sdpa")
    return model


def test_regions_are_opaque_ops_inside_one_inductor_graph():
    model, tokens = _sdpa_llama(), prompts(length=7)
    first = len(STATS.reports)
    compiled = torch.compile(model, backend="kiln")  # the default: fallback="inductor"
    with torch.no_grad():
        got, code = run_and_get_code(lambda: compiled(tokens).logits)
        want = model(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    (report,) = STATS.reports[first:]
    assert report.fallback == "inductor" and dict(report.counts()) == DECODER
    # One Dynamo graph, no break; inductor compiled it once and calls every region from its output code.
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(code) == 1 and code[0].count("torch.ops.kiln_dynamo.region.default(") == report.regions >= 3


def test_generate_with_dynamic_shapes_through_inductor():
    """dynamic=True hands eps and the attention scale over as float inputs; inductor then makes Dynamo restart the
    frame with them specialized (TensorifyScalarRestartAnalysis), which needs Dynamo's own graph left untouched."""
    model, tokens = _sdpa_llama(), prompts(length=5)
    first = len(STATS.reports)
    eager = model.forward
    with torch.no_grad():
        want = model.generate(tokens, max_new_tokens=6, do_sample=False)
        model.forward = torch.compile(eager, backend="kiln", dynamic=True)
        try:
            got = model.generate(tokens, max_new_tokens=6, do_sample=False)
        finally:
            model.forward = eager
    assert torch.equal(got, want)
    reports = STATS.reports[first:]  # 1 prefill + 5 decode steps; no graph per step, each counted once
    assert len(reports) <= 3 and all(dict(r.counts()) == DECODER for r in reports)


# Ops that read a device value on the host (a sync, and a branch CUDA graph capture cannot record) or compute a
# data-dependent shape. A CUDA graph replays launches only: none of these may run in a region's call path.
_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(t), int(t), .tolist()
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.repeat_interleave.Tensor,
    torch.ops.aten._pin_memory.default,
}


class NoHostSync(TorchDispatchMode):
    """Fails on any op in _SYNCS, and on tensors made or copied onto another device than the region's inputs."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.ops = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        masked = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )  # x[mask]: nonzero inside
        if func in _SYNCS or masked:
            raise AssertionError(f"{func} in a kiln region's call path: a host sync, not CUDA-graph safe")
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != self.device.type:
            raise AssertionError(f"{func} makes a tensor on {device} in a region on {self.device}")
        return func(*args, **kwargs)


def test_region_call_path_has_no_host_sync(monkeypatch):
    """Prefill and a cached decode step: every region call (weight check, kernels' host wrappers and launches,
    output copies) runs under NoHostSync."""
    from transformers import DynamicCache

    checked = []
    run = regions.Region.run

    def checked_run(self, inputs):
        with NoHostSync(inputs[0].device) as mode:
            out = run(self, inputs)
        checked.append(mode.ops)
        return out

    monkeypatch.setattr(regions.Region, "run", checked_run)
    model, tokens = _sdpa_llama(), prompts(length=5)
    compiled = torch.compile(model, backend="kiln", options={"fallback": "eager"})  # the same regions, no C++
    with torch.no_grad():
        cache, want_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        got = compiled(tokens, past_key_values=cache, use_cache=True).logits
        want = model(tokens, past_key_values=want_cache, use_cache=True).logits
        step = tokens[:, -1:]
        got_step = compiled(step, past_key_values=cache, use_cache=True).logits
        want_step = model(step, past_key_values=want_cache, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_step, want_step, atol=1e-4, rtol=1e-4)
    reports = [r for r in STATS.reports[-2:]]
    assert sum(r.regions for r in reports) == len(checked) >= 6 and all(n > 0 for n in checked)


def test_the_mode_checks_what_it_claims_to():
    with NoHostSync(torch.device("cpu")):
        x = torch.arange(4.0)
        x + 1  # launches only: fine
        with pytest.raises(AssertionError, match="_local_scalar_dense.*host sync"):
            float(x.sum())
        with pytest.raises(AssertionError, match="nonzero"):
            torch.nonzero(x)
        with pytest.raises(AssertionError, match="index.Tensor"):
            x[x > 1]
        with pytest.raises(AssertionError, match="makes a tensor on meta"):
            torch.empty(2, device="meta")


def test_reduce_overhead_needs_the_inductor_fallback():
    model = torch.nn.Linear(8, 8)
    with pytest.raises(Exception, match="mode='reduce-overhead' with fallback='eager'") as info:
        torch.compile(model, backend="kiln", options={"fallback": "eager", "mode": "reduce-overhead"})(
            torch.randn(2, 8)
        )
    assert isinstance(getattr(info.value, "inner_exception", info.value), KilnError)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.gpu
def test_reduce_overhead_cuda_graphs_equal_eager():
    """CUDA graphs around the whole graph, kiln regions included: every replay equals eager, and kiln makes inductor
    skip no more graphs than inductor's own reduce-overhead on the same model does (HF may cause skips itself)."""
    model, tokens = _sdpa_llama().cuda(), prompts(length=9).cuda()
    skips = torch._dynamo.utils.counters["inductor"]
    with torch.no_grad():
        want = model(tokens, use_cache=False).logits
        inductor = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            inductor(tokens, use_cache=False)
        inductor_skips = skips.get("cudagraph_skips", 0)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln", mode="reduce-overhead")
        # warm-up, recording, then replays: each output cloned before the next call reuses the graph's memory
        outs = [compiled(tokens, use_cache=False).logits.clone() for _ in range(4)]
    for got in outs:  # fp32 model; Triton's fp32 dots may use TF32
        assert _relative_error(got, want) < 1e-2
    assert skips.get("cudagraph_skips", 0) - inductor_skips <= inductor_skips, dict(skips)
    report = STATS.reports[-1]
    assert report.mode == "reduce-overhead" and report.counts()["attention"] == 2 and report.regions >= 3


class CacheStart(torch.nn.Module):
    """HF's DynamicCache.update on its first call: cat([torch.tensor([]), k]) with k a transposed projection."""

    def forward(self, x):
        k = (x * 2).view(2, 6, 2, 16).transpose(1, 2)
        return torch.cat([torch.tensor([]), k], dim=-2)


def test_a_cache_started_from_an_empty_cat_is_contiguous_as_in_eager():
    # Inductor decomposes this cat to a clone that keeps k's transposed layout; the next decode step then sees
    # cache strides that differ from the ones the graph was compiled for, and recompiles.
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        want, got = CacheStart()(x), torch.compile(CacheStart(), backend="kiln")(x)
    assert got.stride() == want.stride() == (192, 96, 16, 1)
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_generate_compiles_as_many_graphs_as_backend_eager():
    """Every kiln output has the strides eager gives it, so Dynamo's stride guards on the KV cache fail no more
    often than with backend="eager" (each extra failure a recompile, up to the recompile limit)."""
    model = build_hf_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("sdpa")
    tokens, forward, counts = prompts(length=6), model.forward, {}
    for backend in ("eager", "kiln"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.forward = torch.compile(forward, backend=backend)
        with torch.no_grad():
            model.generate(tokens, max_new_tokens=4, do_sample=False)
            model.generate(tokens[:1, :4], max_new_tokens=3, do_sample=False)
        counts[backend] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.forward = forward
    assert counts["kiln"] == counts["eager"], counts


def test_a_call_whose_mask_fails_the_check_is_compiled_by_inductor_not_run_as_torch():
    """Left padding makes the mask no longer causal: such calls run Dynamo's graph without kiln's claims, and with
    fallback="inductor" that graph is compiled by inductor (once, at the first such call), not run eagerly."""
    model, tokens = build_hf_model("llama"), prompts(length=8)  # eager attention: the mask is a graph input
    ones, padded = torch.ones_like(tokens), torch.ones_like(tokens)
    padded[0, :3] = 0
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        compiled(tokens, attention_mask=ones)
        graphs, kiln_graphs, fails = torch._dynamo.utils.counters["stats"]["unique_graphs"], STATS.graphs, \
            STATS.mask_fallbacks
        with pytest.warns(UserWarning, match=r"without kiln's kernels \(by inductor\)"):
            got = compiled(tokens, attention_mask=padded).logits
        want = model(tokens, attention_mask=padded).logits
        again = compiled(tokens, attention_mask=padded).logits
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0, 3:], want[0, 3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, got)
    # the two padded calls failed the check; inductor compiled the unclaimed graph once (not through kiln)
    assert (STATS.mask_fallbacks, STATS.graphs) == (fails + 2, kiln_graphs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
