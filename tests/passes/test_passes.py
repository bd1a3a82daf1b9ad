"""Each pass through check_pass on the bundled tiny specs, plus the cases each pass must leave alone."""

from __future__ import annotations

import operator
from functools import partial

import pytest
import torch

from kiln.compile.pipeline import run_pipeline
from kiln.ir.frontend import build_graph
from kiln.model_config import AttentionCall, MlpCall, ModelConfig
from kiln.passes import flash_tiling, gqa_fusion, norm_fusion, rope_fusion
from kiln.passes._graph import attr_tensor, set_param
from kiln.spec.loader import load_spec
from tests.support.pass_helper import check_pass, inputs, plain_mlp_model

ops = torch.ops.kiln
SPLIT = torch.ops.aten.split_with_sizes.default
SPECS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2")


def counts(cfg: ModelConfig) -> tuple[int, int, bool]:
    """(attention sites, gated MLP sites, rope on) over the whole model."""
    sites = cfg.sites()
    attn = sum(1 for s in sites if isinstance(s, AttentionCall)) * cfg.layers
    gated = sum(1 for s in sites if isinstance(s, MlpCall) and s.gated) * cfg.layers
    return attn, gated, cfg.positions == "rope"


def qk_normed(cfg: ModelConfig) -> bool:
    return any(isinstance(s, AttentionCall) and s.qk_norm for s in cfg.sites())


@pytest.mark.parametrize("spec", SPECS)
def test_gqa_fusion(spec):
    cfg = load_spec(spec).model
    attn, gated, _ = counts(cfg)
    delta = {ops.linear.default: -2 * attn - gated, SPLIT: attn + gated, operator.getitem: 3 * attn + 2 * gated}
    gm = check_pass(gqa_fusion.PASS, partial(build_graph, cfg), inputs(cfg), delta)
    names = {n for n, _ in gm.named_parameters()}
    assert "layers.0.attn0.qkv.weight" in names and "layers.0.attn0.q.weight" not in names
    assert ("layers.0.attn0.qkv.bias" in names) == (spec in ("tiny-qwen2", "tiny-gpt2"))
    assert ("layers.0.mlp0.gate_up.weight" in names) == bool(gated)


def test_gqa_fusion_fills_missing_biases_with_zeros():
    cfg = load_spec("tiny-llama").model

    def factory():
        gm = build_graph(cfg)
        q = next(n for n in gm.graph.nodes if n.name == "layers_0_attn0_q")
        gen = torch.Generator().manual_seed(3)
        set_param(gm, "layers.0.attn0.q.bias", torch.randn(attr_tensor(gm, q.args[1]).shape[0], generator=gen))
        with gm.graph.inserting_before(q):
            bias = gm.graph.get_attr("layers.0.attn0.q.bias")
        q.args = (*q.args[:2], bias)
        gm.recompile()
        return gm

    delta = {ops.linear.default: -2 * cfg.layers - cfg.layers, SPLIT: 2 * cfg.layers, operator.getitem: 5 * cfg.layers}
    gm = check_pass(gqa_fusion.PASS, factory, inputs(cfg), delta)
    bias = gm.get_parameter("layers.0.attn0.qkv.bias")
    q_out = cfg.heads * cfg.head_dim
    assert bias.shape == ((cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim,)
    assert bias[q_out:].abs().max() == 0 and bias[:q_out].abs().max() > 0
    assert not any(n.endswith("qkv.bias") for n, _ in gm.named_parameters() if n.startswith("layers.1"))


def _gqa_fused(cfg: ModelConfig):
    return run_pipeline(build_graph(cfg), [gqa_fusion.PASS], debug=True)


@pytest.mark.parametrize("spec", SPECS)
def test_rope_fusion(spec):
    cfg = load_spec(spec).model
    attn, _, rope = counts(cfg)
    delta = {ops.rope.default: -attn, SPLIT: attn, operator.getitem: attn} if rope else {}
    if rope and qk_normed(cfg):  # tiny-qwen3: both q/k norms and both ropes become one kiln::qk_norm_rope
        delta = {ops.rope.default: -2 * attn, ops.head_rms_norm.default: -2 * attn, ops.qk_norm_rope.default: attn,
                 SPLIT: attn, operator.getitem: attn}  # fmt: skip
    check_pass(rope_fusion.PASS, partial(_gqa_fused, cfg), inputs(cfg), delta)


def test_rope_fusion_needs_fused_projections():
    cfg = load_spec("tiny-llama").model
    check_pass(rope_fusion.PASS, partial(build_graph, cfg), inputs(cfg), {})
    assert rope_fusion.PASS.requires == ("gqa_fusion",)


@pytest.mark.parametrize("spec", SPECS)
def test_norm_fusion(spec):
    cfg = load_spec(spec).model
    # Every residual add feeds the next norm: two per layer, plus the position-embedding add (learned positions).
    fused = 2 * cfg.layers + (cfg.positions == "learned")
    norm, add_norm = (
        (ops.rms_norm.default, ops.add_rms_norm.default)
        if cfg.norm.kind == "rms"
        else (ops.layer_norm.default, ops.add_layer_norm.default)
    )
    # getitem: the normed output of each, the sum of each but the last (the final norm's input is read once).
    delta = {ops.add.default: -fused, norm: -fused, add_norm: fused, operator.getitem: 2 * fused - 1}
    check_pass(norm_fusion.PASS, partial(build_graph, cfg), inputs(cfg), delta)


@pytest.mark.parametrize("spec", SPECS)
def test_flash_tiling(spec):
    cfg = load_spec(spec).model
    attn, _, _ = counts(cfg)
    delta = {ops.attention.default: -attn, ops.flash_attention.default: attn}
    gm = check_pass(flash_tiling.PASS, partial(build_graph, cfg), inputs(cfg), delta)
    node = next(n for n in gm.graph.nodes if n.target == ops.flash_attention.default)
    from kiln.codegen.tiles import default_tile

    tile = default_tile(cfg.head_dim, torch.float32, None)
    assert node.args[8:] == (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)
    assert node.meta["tile"]["block_m"] == tile.block_m


@pytest.mark.parametrize("pass_", [gqa_fusion.PASS, rope_fusion.PASS, norm_fusion.PASS, flash_tiling.PASS],
                         ids=lambda p: p.name)
def test_nothing_to_match(pass_):
    cfg = plain_mlp_model()
    check_pass(pass_, partial(build_graph, cfg), inputs(cfg), {})


def test_pass_docstrings_say_what_they_match():
    for p in (gqa_fusion.PASS, rope_fusion.PASS, norm_fusion.PASS, flash_tiling.PASS):
        for word in ("Matches", "Emits", "Requires"):
            assert word in p.doc, f"{p.name}: docstring lacks {word!r}"
