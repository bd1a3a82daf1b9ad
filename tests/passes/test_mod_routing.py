"""mod_routing through check_pass on the MoD specs (both forms, both decisions, no rope), what it leaves alone, and
its composition with the rest of the model pipeline."""

from __future__ import annotations

import dataclasses
import operator
from functools import partial

import pytest
import torch

from kiln.compile.driver import compile_model
from kiln.compile.pipeline import build_pipeline, run_pipeline
from kiln.ir.frontend import build_graph
from kiln.model_config import ModConfig
from kiln.passes import mod_routing
from kiln.spec.loader import load_spec
from tests.support.pass_helper import check_pass, inputs

ops = torch.ops.kiln


def _cfg(name: str, **route):
    cfg = load_spec(name).model
    return dataclasses.replace(cfg, route=dataclasses.replace(cfg.route, **route)) if route else cfg


def _gpt2_mod():
    """Learned positions, layer norm, biases, no rope: the compact body never reads the positions."""
    return dataclasses.replace(load_spec("tiny-gpt2").model, route=ModConfig(0.5, 2))


def _qwen3_mod():
    """q/k norms (kiln::head_rms_norm) in the compact body, head_dim 32 != dim / heads."""
    return dataclasses.replace(load_spec("tiny-qwen3").model, route=ModConfig(0.5, 2))


CASES = {  # name -> (config, form, fused threshold kernel, body reads positions)
    "llama-threshold-causal": (partial(_cfg, "tiny-llama-mod"), "causal", True, True),
    "llama-training": (partial(_cfg, "tiny-llama-mod"), "training", False, True),
    "mistral-predictor-causal": (partial(_cfg, "tiny-mistral-mod"), "causal", False, True),
    "mistral-training-0.3": (partial(_cfg, "tiny-mistral-mod", capacity=0.3), "training", False, True),
    "gpt2-threshold-causal": (_gpt2_mod, "causal", True, False),
    "qwen3-threshold-causal": (_qwen3_mod, "causal", True, True),
    "qwen3-training": (_qwen3_mod, "training", False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mod_routing(case):
    make, form, fused, reads_positions = CASES[case]
    cfg = make()
    routed = sum(cfg.route.routed(i) for i in range(cfg.layers))
    assert routed >= 1
    items = (5 if fused else 4) - (0 if reads_positions else 1)  # getitems: (r,) index, count, xs, (xpos)
    delta = {ops.mod_combine.default: -routed, ops.routed_attention.default: -routed, ops.attention.default: routed,
             ops.mod_scatter.default: routed, operator.getitem: items * routed}
    if fused:
        delta |= {ops.mod_route.default: routed, ops.mod_router.default: -routed,
                  ops.mod_threshold_mask.default: -routed}
    else:
        delta[ops.mod_gather.default] = routed
    gm = check_pass(mod_routing.PASS, partial(build_graph, cfg, mod_form=form), inputs(cfg, seq=13), delta)
    # The compact body runs on C rows: T in the causal form (the bound), ceil(capacity * T) in the training form.
    rows = 8 if form == "causal" else {0.5: 4, 0.3: 3}[cfg.route.capacity]  # propagation's example: T = 8
    attention = [n for n in gm.graph.nodes if n.target == ops.attention.default]
    by_layer = {n.name.split("_")[1]: n for n in attention}
    for i in range(cfg.layers):
        assert by_layer[str(i)].meta["val"].shape[1] == (rows if cfg.route.routed(i) else 8)


def test_dense_models_and_disabled_layers_are_left_alone():
    cfg = load_spec("tiny-llama").model
    check_pass(mod_routing.PASS, partial(build_graph, cfg), inputs(cfg), {})


def test_gathered_counts_are_the_routed_tokens():
    cfg = _cfg("tiny-llama-mod")
    gm = build_graph(cfg)
    tokens, positions = inputs(cfg, seq=13)
    masks, counts = {}, {}

    class Record(torch.fx.Interpreter):
        def __init__(self, gm, out):
            super().__init__(gm)
            self.out = out

        def run_node(self, n):
            v = super().run_node(n)
            if n.target == ops.mod_threshold_mask.default:
                self.out[n.name.split("_")[1]] = v.sum(-1)
            if n.target == ops.mod_route.default:
                self.out[n.name.split("_")[1]] = v[2]
            return v

    with torch.no_grad():
        Record(gm, masks).run(tokens, positions)
        passed = mod_routing.PASS.run(build_graph(cfg)).gm
        passed.recompile()
        Record(passed, counts).run(tokens, positions)
    assert masks.keys() == counts.keys() == {"1", "3"}
    for layer in masks:
        assert torch.equal(masks[layer], counts[layer])
        assert 0 < int(counts[layer].min()) and int(counts[layer].max()) < 13


@pytest.mark.parametrize("name", ["tiny-llama-mod", "tiny-mistral-mod"])
def test_the_model_pipeline_runs_mod_routing_first_and_stays_equal(name):
    loaded = load_spec(name)
    assert loaded.compile.extra["route"] == loaded.model.route
    names = [p.name for p in build_pipeline(loaded.compile)]
    assert names == ["mod_routing", "gqa_fusion", "rope_fusion", "norm_fusion", "flash_tiling"]
    tokens, positions = inputs(loaded.model, seq=13)
    want = build_graph(loaded.model)(tokens, positions)
    compiled = compile_model(build_graph(loaded.model), loaded.compile, use_kernels=False)
    targets = {n.target for n in compiled.gm.graph.nodes}
    assert ops.mod_scatter.default in targets and ops.flash_attention.default in targets
    assert ops.routed_attention.default not in targets and ops.attention.default not in targets
    assert any(n.name.endswith("qkv") for n in compiled.gm.graph.nodes)  # gqa_fusion fused the compact body too
    torch.testing.assert_close(compiled(tokens, positions), want, atol=1e-5, rtol=1e-5)


def test_quantize_composes_with_mod_routing():
    from kiln.quant.formats import parse_scheme

    loaded = load_spec("tiny-llama-mod")
    comp = dataclasses.replace(loaded.compile, extra={**loaded.compile.extra, "quantize": parse_scheme("int8")})
    tokens, positions = inputs(loaded.model, seq=13)
    routed = run_pipeline(build_graph(loaded.model), build_pipeline(comp))
    dense_masked = run_pipeline(build_graph(loaded.model), build_pipeline(comp, {"mod_routing": False}))
    assert ops.mod_scatter.default in {n.target for n in routed.graph.nodes}
    assert ops.mod_combine.default in {n.target for n in dense_masked.graph.nodes}
    # qkv, o, gate_up and down of every layer, the compact bodies included
    assert sum(n.target == ops.linear_w8.default for n in routed.graph.nodes) == 4 * loaded.model.layers
    torch.testing.assert_close(routed(tokens, positions), dense_masked(tokens, positions), atol=1e-5, rtol=1e-5)


def test_without_a_route_the_pipeline_does_not_run_it():
    assert "mod_routing" not in [p.name for p in build_pipeline(load_spec("tiny-llama").compile)]
