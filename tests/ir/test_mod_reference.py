"""Mixture-of-Depths at Level 1: the dense-masked reference against the dense model and an independent loop,
the ops' semantics, and the router weights (random init, checkpoints)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import KilnError, WeightError
from kiln.ir.frontend import build_graph, random_weights, router_start
from kiln.ir.ops_mod import mod_rows
from kiln.model_config import ModConfig, param_shapes
from kiln.spec.loader import load_spec

kiln_ops = torch.ops.kiln
SPECS = ("tiny-llama-mod", "tiny-mistral-mod")


def _inputs(b: int = 2, t: int = 13, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (b, t), generator=g), torch.arange(t).expand(b, t).contiguous()


def _unit_routers(cfg, weights: dict) -> dict:
    """weight 0, bias 1 (r = 1 everywhere), threshold 0, and a predictor whose logit is 1: every token routes."""
    out = dict(weights)
    for name, t in weights.items():
        if ".router." in name:
            one = name.endswith(("router.bias", "fc2.bias"))
            out[name] = torch.full_like(t, 1.0 if one else 0.0)
    return out


@pytest.mark.parametrize("form", ["causal", "training"])
@pytest.mark.parametrize("name", SPECS)
def test_capacity_one_with_unit_routers_equals_the_dense_model(name, form):
    cfg = dataclasses.replace(load_spec(name).model, route=dataclasses.replace(load_spec(name).model.route,
                                                                                 capacity=1.0))
    dense_cfg = dataclasses.replace(cfg, route=None)
    weights = _unit_routers(cfg, random_weights(cfg, seed=3))
    dense = build_graph(dense_cfg, {n: weights[n] for n in param_shapes(dense_cfg)})
    routed = build_graph(cfg, weights, mod_form=form)
    tokens, positions = _inputs()
    with torch.no_grad():
        want, got = dense(tokens, positions), routed(tokens, positions)
    ops = {n.target for n in routed.graph.nodes}
    assert kiln_ops.routed_attention.default in ops and kiln_ops.mod_combine.default in ops
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- an independent per-token loop: gather the routed rows, run the layer on them, scatter back ---------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, inv_freq, heads):
    n, hd = x.shape
    d = hd // heads
    f = pos.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat((f, f), -1).cos()[:, None], torch.cat((f, f), -1).sin()[:, None]
    xh = x.view(n, heads, d)
    rot = torch.cat((-xh[..., d // 2:], xh[..., : d // 2]), -1)
    return (xh * cos + rot * sin).reshape(n, hd)


def _layer(p, i, x, pos, cfg, inv_freq):
    """One llama layer over n rows of one sequence, attending causally among these rows only."""
    w = lambda name: p[f"layers.{i}.{name}"]  # noqa: E731
    site = cfg.body[0].value.right
    h = _rms(x, w("norm0.weight"), cfg.norm.eps)
    q = _rope(h @ w("attn0.q.weight").t(), pos, inv_freq, cfg.heads)
    k = _rope(h @ w("attn0.k.weight").t(), pos, inv_freq, cfg.kv_heads)
    v = h @ w("attn0.v.weight").t()
    n, d, g = x.shape[0], cfg.head_dim, cfg.heads // cfg.kv_heads
    qh = q.view(n, cfg.heads, d).transpose(0, 1)
    kh = k.view(n, cfg.kv_heads, d).transpose(0, 1).repeat_interleave(g, 0)
    vh = v.view(n, cfg.kv_heads, d).transpose(0, 1).repeat_interleave(g, 0)
    a, b = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (b <= a) & ((a - b < site.window) if site.window else True)  # window over the routed rows
    att = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=d**-0.5)
    x = x + att.transpose(0, 1).reshape(n, -1) @ w("attn0.o.weight").t()
    h = _rms(x, w("norm1.weight"), cfg.norm.eps)
    return x + (F.silu(h @ w("mlp0.gate.weight").t()) * (h @ w("mlp0.up.weight").t())) @ w("mlp0.down.weight").t()


def _loop_forward(gm, cfg, tokens):
    p = {n: t.detach() for n, t in gm.named_parameters()}
    inv_freq = gm.get_buffer("rope_inv_freq")
    out, routed_counts = [], []
    for seq in tokens:
        x, pos = p["embed.weight"][seq], torch.arange(len(seq))
        for i in range(cfg.layers):
            if not cfg.route.routed(i):
                x = _layer(p, i, x, pos, cfg, inv_freq)
                continue
            rp = f"layers.{i}.router"
            r = x @ p[f"{rp}.weight"][0] + p[f"{rp}.bias"][0]
            if cfg.route.decide == "predictor":
                h = F.silu(x @ p[f"{rp}.predictor.fc1.weight"].t() + p[f"{rp}.predictor.fc1.bias"])
                chosen = h @ p[f"{rp}.predictor.fc2.weight"][0] + p[f"{rp}.predictor.fc2.bias"][0] > 0
            else:
                chosen = r > p[f"{rp}.threshold"][0]
            idx = chosen.nonzero()[:, 0]
            routed_counts.append(len(idx))
            x = x.clone()
            if len(idx):
                xs = x[idx]
                x[idx] = xs + r[idx, None] * (_layer(p, i, xs, pos[idx], cfg, inv_freq) - xs)
        out.append(_rms(x, p["final_norm.weight"], cfg.norm.eps) @ p["lm_head.weight"].t())
    return torch.stack(out), routed_counts


@pytest.mark.parametrize("decide", ["threshold", "predictor"])
@pytest.mark.parametrize("name", SPECS)
def test_causal_form_equals_an_independent_gather_loop(name, decide):
    cfg = load_spec(name).model
    cfg = dataclasses.replace(cfg, route=ModConfig(0.5, 2, decide, 24 if decide == "predictor" else 0))
    gm = build_graph(cfg, seed=1)
    tokens, positions = _inputs(b=3, t=21, seed=2)
    with torch.no_grad():
        got = gm(tokens, positions)
        want, counts = _loop_forward(gm, cfg, tokens)
    assert any(0 < c < 21 for c in counts), f"routing must be partial to test anything, got counts {counts}"
    assert len(set(counts)) > 1, "sequences should route different numbers of tokens"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_training_form_routes_exactly_the_capacity_per_sequence():
    cfg = load_spec("tiny-llama-mod").model
    cfg = dataclasses.replace(cfg, route=dataclasses.replace(cfg.route, capacity=0.3))
    gm = build_graph(cfg, mod_form="training")
    masks = [n for n in gm.graph.nodes if n.target == kiln_ops.mod_topk_mask.default]
    assert len(masks) == 2
    tokens, positions = _inputs(b=2, t=17)
    seen = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n in masks:
                seen[n.name] = v
            return v

    with torch.no_grad():
        Record(gm).run(tokens, positions)
    for mask in seen.values():
        assert mask.sum(-1).tolist() == [mod_rows(0.3, 17)] * 2 == [6, 6]


def test_topk_mask_breaks_ties_by_position_and_rounds_capacity():
    score = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    assert kiln_ops.mod_topk_mask(score, 0.4).tolist() == [[False, True, True, False, False]]
    assert mod_rows(0.1, 30) == 3 and mod_rows(0.125, 8) == 1 and mod_rows(0.01, 5) == 1 and mod_rows(1.0, 7) == 7


def test_routed_attention_is_attention_among_the_routed_keys():
    g = torch.Generator().manual_seed(0)
    b, t, h, hkv, d = 2, 11, 4, 2, 8
    q, k, v = (torch.randn(b, t, n * d, generator=g) for n in (h, hkv, hkv))
    routed = torch.rand(b, t, generator=g) < 0.6
    routed[:, 0] = True
    for window in (0, 3):
        out = kiln_ops.routed_attention(q, k, v, routed, h, hkv, True, window, d**-0.5)
        for s in range(b):
            idx = routed[s].nonzero()[:, 0]
            want = kiln_ops.attention(q[s:s + 1, idx], k[s:s + 1, idx], v[s:s + 1, idx], h, hkv, True, window,
                                      d**-0.5)
            torch.testing.assert_close(out[s, idx], want[0], atol=1e-6, rtol=1e-6)
        assert torch.isfinite(out).all()
    everyone = torch.ones(b, t, dtype=torch.bool)
    torch.testing.assert_close(kiln_ops.routed_attention(q, k, v, everyone, h, hkv, True, 3, 0.3),
                               kiln_ops.attention(q, k, v, h, hkv, True, 3, 0.3))


def test_unknown_mod_form_is_refused():
    with pytest.raises(KilnError, match="mod_form 'topk' is not a Mixture-of-Depths form; use one of causal"):
        build_graph(load_spec("tiny-llama-mod").model, mod_form="topk")


# ---- router weights -------------------------------------------------------------------------------------------


def test_random_routers_start_near_the_dense_model():
    cfg = load_spec("tiny-mistral-mod").model
    w = random_weights(cfg, seed=0)
    assert w["layers.1.router.bias"].item() == 1.0
    assert w["layers.1.router.threshold"].item() == router_start(cfg)["threshold"] == 1.0  # capacity 0.5
    assert 0 < w["layers.3.router.weight"].abs().max() < 1.0
    assert w["layers.1.router.predictor.fc1.weight"].std() > 0 and w["layers.1.router.predictor.fc2.bias"] == 0
    low = dataclasses.replace(cfg, route=ModConfig(0.125, 2))
    assert router_start(low)["threshold"] == pytest.approx(1 + 1.1503494 / 8, abs=1e-6)
    assert router_start(dataclasses.replace(cfg, route=ModConfig(1.0, 2)))["threshold"] == 0.0


def _save_hf(tmp_path, cfg, weights, drop=()):
    from safetensors.torch import save_file

    from kiln.hf.weight_plan import weight_plan

    tensors = {src.hf: weights[src.targets[0]].contiguous() for src in weight_plan(cfg, "llama")
               if src.targets[0] not in drop}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tensors


def test_safetensors_round_trip_keeps_the_routers(tmp_path):
    from kiln.hf.weights import load_hf_weights

    cfg = load_spec("tiny-mistral-mod").model
    weights = random_weights(cfg, seed=5)
    saved = _save_hf(tmp_path, cfg, weights)
    assert "model.layers.1.router.predictor.fc1.weight" in saved and "model.layers.3.router.threshold" in saved
    loaded = load_hf_weights(tmp_path, cfg, model_type="llama")
    assert list(loaded) == list(param_shapes(cfg))
    for n, t in weights.items():
        assert torch.equal(loaded[n], t), n
    tokens, positions = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(build_graph(cfg, loaded)(tokens, positions),
                                   build_graph(cfg, weights)(tokens, positions), atol=1e-5, rtol=1e-5)


def test_checkpoint_without_routers_is_refused_naming_them(tmp_path):
    from kiln.hf.weights import load_hf_weights

    cfg = load_spec("tiny-llama-mod").model
    dense = dataclasses.replace(cfg, route=None)
    weights = random_weights(cfg, seed=5)
    _save_hf(tmp_path, cfg, weights, drop=[n for n in weights if ".router." in n])
    with pytest.raises(WeightError) as info:
        load_hf_weights(tmp_path, cfg, model_type="llama")
    msg = str(info.value)
    for i in (1, 3):
        for t in ("weight", "bias", "threshold"):
            assert f"missing tensor model.layers.{i}.router.{t} (for kiln layers.{i}.router.{t}" in msg
    assert "lacks 6 router tensor(s)" in msg and "remove the route setting" in msg
    assert load_hf_weights(tmp_path, dense, model_type="llama").keys() == param_shapes(dense).keys()
    with pytest.raises(WeightError, match="layers.1.router.weight"):  # the same for weights given in Python
        build_graph(cfg, {n: t for n, t in weights.items() if ".router." not in n})


# ---- the engine path: served over the routed KV cache (tests/runtime/test_routed_kv*.py check its outputs) ------


def test_kiln_run_serves_a_routed_model_and_refuses_what_is_not_built(capsys):
    from kiln import LLM
    from kiln.cli.commands import main
    from kiln.compile.step import compile_step

    assert main(["run", "tiny-llama-mod", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu"]) == 0
    assert "routed KV cache:" in capsys.readouterr().err  # the load line reports the KV memory saved
    loaded = load_spec("tiny-llama-mod")
    with pytest.raises(KilnError, match="'tiny-llama-mod' routes layers .* int8 KV cache is not built"):
        compile_step(build_graph(loaded.model), loaded.model, loaded.compile, kv_cache_dtype="int8")
    with pytest.raises(KilnError, match="speculative decoding is not built for Mixture-of-Depths"):
        LLM("tiny-mistral-mod", device="cpu", speculation="ngram(n = 2, k = 2)")


def test_the_uncached_reference_path_generates_with_routing():
    from kiln.reference import generate
    from kiln.runtime.sampling_params import SamplingParams

    cfg = load_spec("tiny-llama-mod").model
    params = SamplingParams(temperature=0, max_tokens=6)
    routed = generate(build_graph(cfg, seed=2), [5, 9, 13, 2], params, context=cfg.context)
    dense_cfg = dataclasses.replace(cfg, route=None)
    dense_weights = {n: t for n, t in random_weights(cfg, seed=2).items() if ".router." not in n}
    dense = generate(build_graph(dense_cfg, dense_weights), [5, 9, 13, 2], params, context=cfg.context)
    assert len(routed.token_ids) == 6 and routed.finish_reason == "length"
    assert routed.token_ids == generate(build_graph(cfg, seed=2), [5, 9, 13, 2], params, context=cfg.context).token_ids
    assert routed.token_ids != dense.token_ids  # routing changes the model: it is not the dense one
