"""self_draft (passes/speculative.py): the target cut to its first L layers computes what the same model built with L
layers and those layers' weights computes, shares its weights with the target, and leaves the target as it was."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from kiln.errors import PassError
from kiln.ir.frontend import build_graph
from kiln.model_config import ModelConfig, param_shapes
from kiln.passes.speculative import make_pass, self_draft_graph
from kiln.spec.loader import load_spec
from tests.support.model_configs import tiny_gpt2, tiny_llama, tiny_parallel
from tests.support.pass_helper import check_pass, inputs, node_delta, op_counts, plain_mlp_model


def cut(cfg: ModelConfig, layers: int, seed: int = 3) -> torch.fx.GraphModule:
    """The reference: the model built with `layers` layers and the full model's weights for them."""
    full = build_graph(cfg, seed=seed)
    small = dataclasses.replace(cfg, layers=layers)
    weights = {name: full.get_parameter(name) for name in param_shapes(small)}
    return build_graph(small, weights)


CASES = {  # name -> (config, L)
    "llama 3 -> 1": (tiny_llama(layers=3), 1),
    "llama 3 -> 2": (tiny_llama(layers=3), 2),
    "llama tied 2 -> 1": (tiny_llama(layers=2, tie=True), 1),
    "gpt2 (layer norm, learned positions, biases)": (tiny_gpt2(), 1),
    "parallel attention + mlp": (dataclasses.replace(tiny_parallel(), layers=3), 2),
    "no final norm": (dataclasses.replace(tiny_llama(layers=2), final_norm=False), 1),
    "mistral (sliding window)": (load_spec("tiny-mistral").model, 1),
    "qwen3 (q/k norms, head_dim != dim / heads)": (load_spec("tiny-qwen3").model, 1),
}


@pytest.mark.parametrize("case", CASES)
def test_self_draft_equals_the_model_built_with_L_layers(case):
    cfg, layers = CASES[case]
    factory = partial(build_graph, cfg, seed=3)
    reference = partial(cut, cfg, layers)
    delta = node_delta(op_counts(factory()), op_counts(reference()))
    assert delta, "the cut must drop nodes"
    check_pass(make_pass(layers), factory, inputs(cfg), delta, reference=reference)


def test_the_copy_shares_weights_and_leaves_the_target_alone():
    cfg = tiny_llama(layers=3)
    gm = build_graph(cfg, seed=5)
    before_text = str(gm.graph)
    x = inputs(cfg)
    with torch.no_grad():
        before = gm(*x)
    draft = self_draft_graph(gm, 1)
    assert str(gm.graph) == before_text
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), before, atol=0, rtol=0)
        torch.testing.assert_close(draft(*x), cut(cfg, 1, seed=5)(*x), atol=1e-5, rtol=1e-5)
    kept = dict(draft.named_parameters())
    assert set(kept) == set(param_shapes(dataclasses.replace(cfg, layers=1)))
    assert all(t is gm.get_parameter(name) for name, t in kept.items())  # shared, not copied
    assert dict(draft.named_buffers())["rope_inv_freq"] is gm.get_buffer("rope_inv_freq")
    assert "rope_inv_freq" not in draft.state_dict()  # still derived from the config, not a weight


def test_errors_name_the_layers():
    cfg = tiny_llama(layers=2)
    with pytest.raises(PassError, match="layers = 3 but the model has 2"):
        self_draft_graph(build_graph(cfg), 3)
    with pytest.raises(PassError, match="needs at least one layer"):
        self_draft_graph(build_graph(cfg), 0)
    gm = build_graph(cfg)
    for n in gm.graph.nodes:  # a graph whose nodes lost the frontend's names
        n.name = n.name.replace("layers_", "blk_")
    with pytest.raises(PassError, match="no nodes named layers_"):
        make_pass(1).run(gm)


def test_all_layers_kept_is_no_change():
    cfg = plain_mlp_model()
    gm = build_graph(cfg)
    text = str(gm.graph)
    assert not make_pass(1).run(gm).modified and str(gm.graph) == text
