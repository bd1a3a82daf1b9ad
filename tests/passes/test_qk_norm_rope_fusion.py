"""rope_fusion at a q/k-normed attention site (Qwen3): split [q, k, v] -> head_rms_norm -> rope on q and on k
becomes split [q + k, v] -> one kiln::qk_norm_rope -> split [q, k]; the sites it must leave alone; Llama's sites
still get the plain one-rope fusion."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import fx

from kiln.compile.pipeline import build_pipeline, run_pipeline
from kiln.ir.frontend import build_graph, random_weights
from kiln.model_config import ModConfig
from kiln.passes import gqa_fusion, mod_routing, rope_fusion
from kiln.passes._graph import erase_attr_if_unused, set_param
from kiln.spec.loader import load_spec
from tests.support.pass_helper import check_pass, inputs, op_counts

ops = torch.ops.kiln
SPLIT = torch.ops.aten.split_with_sizes.default
QWEN3 = load_spec("tiny-qwen3").model


def _weights(cfg, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights whose q_norm and k_norm weights differ from each other (and from ones): a swapped one shows."""
    weights = random_weights(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith((".q_norm.weight", ".k_norm.weight")):
            weights[name] = w + 0.5 * torch.randn(w.shape, generator=g)
    return {k: v.to(dtype) for k, v in weights.items()}


def _fused_qkv(cfg=QWEN3, dtype=torch.float32, edit: Callable[[fx.GraphModule], None] | None = None):
    gm = build_graph(cfg, _weights(cfg), dtype=dtype)
    if edit is not None:
        edit(gm)
        gm.graph.lint()
        gm.recompile()
    return run_pipeline(gm, [gqa_fusion.PASS], debug=True)


def _nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


FUSED_DELTA = {ops.rope.default: -2 * QWEN3.layers, ops.head_rms_norm.default: -2 * QWEN3.layers,
               ops.qk_norm_rope.default: QWEN3.layers, SPLIT: QWEN3.layers, operator.getitem: QWEN3.layers}  # fmt: skip


def test_each_qwen3_layer_gets_one_fused_op_and_keeps_its_values():
    gm = check_pass(rope_fusion.PASS, _fused_qkv, inputs(QWEN3), FUSED_DELTA)
    counts = op_counts(gm)
    assert counts[ops.qk_norm_rope.default] == QWEN3.layers
    assert counts[ops.head_rms_norm.default] == counts[ops.rope.default] == 0
    q_features, k_features = QWEN3.heads * QWEN3.head_dim, QWEN3.kv_heads * QWEN3.head_dim
    for layer, node in enumerate(_nodes(gm, ops.qk_norm_rope.default)):
        qk, q_w, k_w, q_size, eps, positions, inv_freq = node.args
        site = f"layers.{layer}.attn0"
        assert (q_w.target, k_w.target) == (f"{site}.q_norm.weight", f"{site}.k_norm.weight")
        assert (q_size, eps) == (q_features, QWEN3.norm.eps)
        assert positions.op == "placeholder" and inv_freq.target == "rope_inv_freq"
        # qk is piece 0 of the projection's split, now [q + k, v]; the result splits back into q and k for attention
        assert qk.args[1] == 0 and qk.args[0].args[1] == [q_features + k_features, k_features]
        (back,) = node.users
        assert back.target == SPLIT and back.args[1:] == ([q_features, k_features], -1)
        attention = next(iter(next(iter(back.users)).users))
        assert [a.args for a in attention.args[:2]] == [(back, 0), (back, 1)]


def test_the_fused_op_is_bitwise_the_unfused_reference_ops_in_bf16():
    """Its reference composes head_rms_norm and rope: the same roundings, so the same bits, through the model."""
    tokens, positions = inputs(QWEN3)
    unpassed = _fused_qkv(dtype=torch.bfloat16)
    passed = rope_fusion.PASS.run(_fused_qkv(dtype=torch.bfloat16)).gm
    passed.recompile()
    assert op_counts(passed)[ops.qk_norm_rope.default] == QWEN3.layers
    with torch.no_grad():
        assert torch.equal(passed(tokens, positions), unpassed(tokens, positions))


def test_llama_sites_keep_the_plain_rope_fusion():
    cfg = load_spec("tiny-llama").model
    gm = rope_fusion.PASS.run(_fused_qkv(cfg)).gm
    ropes = _nodes(gm, ops.rope.default)
    assert len(ropes) == cfg.layers and not _nodes(gm, ops.qk_norm_rope.default)
    for rope in ropes:
        assert rope.args[0].name.endswith("_qkv_qk") and rope.name.endswith("_qkv_qk_rope")


def test_the_fused_op_runs_in_the_compact_body_of_a_routed_layer():
    cfg = dataclasses.replace(QWEN3, route=ModConfig(0.5, 2))
    gm = run_pipeline(build_graph(cfg, _weights(cfg)), [mod_routing.PASS, gqa_fusion.PASS, rope_fusion.PASS],
                      debug=True)  # fmt: skip
    assert op_counts(gm)[ops.qk_norm_rope.default] == cfg.layers
    assert not _nodes(gm, ops.head_rms_norm.default) and not _nodes(gm, ops.rope.default)


def test_the_default_pipeline_fuses_a_qwen3_model():
    loaded = load_spec("qwen3-0.6b")
    gm = run_pipeline(build_graph(loaded.model, device="meta"), build_pipeline(loaded.compile), debug=True)
    counts = op_counts(gm)
    assert counts[ops.qk_norm_rope.default] == loaded.model.layers
    assert counts[ops.head_rms_norm.default] == counts[ops.rope.default] == 0


# ---- sites that must not match ---------------------------------------------------------------------------------


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _other_eps(gm: fx.GraphModule) -> None:
    k_norm = _node(gm, "layers_0_attn0_k_norm")
    k_norm.args = (*k_norm.args[:2], 1e-3)


def _second_reader(gm: fx.GraphModule) -> None:
    """q's norm also read by an add that attention then reads (the norm output is needed on its own)."""
    q_norm, q_rope = _node(gm, "layers_0_attn0_q_norm"), _node(gm, "layers_0_attn0_q_rope")
    with gm.graph.inserting_after(q_rope):
        both = gm.graph.call_function(ops.add.default, (q_norm, q_rope))
    q_rope.replace_all_uses_with(both, delete_user_cb=lambda user: user is not both)


def _k_not_normed(gm: fx.GraphModule) -> None:
    k_norm = _node(gm, "layers_0_attn0_k_norm")
    weight = k_norm.args[1]
    k_norm.replace_all_uses_with(k_norm.args[0])
    gm.graph.erase_node(k_norm)
    erase_attr_if_unused(gm, weight)


def _half_head_norms(gm: fx.GraphModule) -> None:
    """Norms over half heads (weights of head_dim / 2): valid head_rms_norms, but not over rope's heads."""
    half = QWEN3.head_dim // 2
    for p in ("q", "k"):
        norm = _node(gm, f"layers_0_attn0_{p}_norm")
        set_param(gm, f"layers.0.attn0.{p}_norm.short", torch.linspace(0.5, 1.5, half))
        with gm.graph.inserting_before(norm):
            weight = gm.graph.get_attr(f"layers.0.attn0.{p}_norm.short")
        old = norm.args[1]
        norm.args = (norm.args[0], weight, norm.args[2])
        erase_attr_if_unused(gm, old)


LEFT_ALONE = {"q and k norms with different eps": _other_eps, "a second reader of q's norm": _second_reader,
              "only q normed": _k_not_normed, "norms over other heads than rope's": _half_head_norms}  # fmt: skip


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_a_site_that_differs_is_left_alone(case):
    """Layer 0 edited so it must not fuse; layer 1 still does."""
    one_layer = {op: d // QWEN3.layers for op, d in FUSED_DELTA.items()}
    gm = check_pass(rope_fusion.PASS, partial(_fused_qkv, edit=LEFT_ALONE[case]), inputs(QWEN3), one_layer)
    assert [n.name for n in _nodes(gm, ops.qk_norm_rope.default)] == ["layers_1_attn0_qkv_qk_norm_rope"]
