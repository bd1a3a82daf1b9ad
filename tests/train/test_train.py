"""kiln.train: the differentiable interpreter, router distillation, threshold/predictor calibration, FLOPs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from kiln.ir.frontend import build_graph, random_weights
from kiln.model_config import ModConfig
from kiln.spec.loader import load_spec
from kiln.train.differentiable import Differentiable
from kiln.train.flops import flops_per_token, layer_flops
from kiln.train.routers import RouterTraining, _scores, distil, initial_routers, windows
from kiln.train.scratch import ScratchTraining, train_from_scratch
from tests.support.train_data import DENSE, IDS


@pytest.mark.parametrize("form", ["causal", "training"])
def test_differentiable_equals_the_graph(form):
    cfg = load_spec("tiny-llama-mod").model
    gm = build_graph(cfg, mod_form=form)
    tokens = torch.randint(0, cfg.vocab, (2, 13), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(13).expand(2, 13).contiguous()
    torch.testing.assert_close(Differentiable(gm).forward(tokens, pos), gm(tokens, pos), rtol=0, atol=0)


def test_gradients_reach_only_what_is_trained():
    cfg = dataclasses.replace(DENSE, route=ModConfig(0.5))
    gm = build_graph(cfg, {**random_weights(cfg), **initial_routers(cfg)}, mod_form="training")
    for name, p in gm.named_parameters():
        p.requires_grad_(".router." in name and not name.endswith("threshold"))
    out = Differentiable(gm).forward(torch.tensor([IDS[:17]]))
    out.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in gm.named_parameters()}
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if n.endswith(("router.weight",
                                                                                             "router.bias")))
    assert all(g is None for n, g in grads.items() if ".router." not in n)


def _kl(cfg, weights, batch):
    teacher = build_graph(DENSE, {k: v for k, v in weights.items() if ".router." not in k})
    student = build_graph(cfg, weights, mod_form="training")
    pos = torch.arange(batch.shape[1]).expand(*batch.shape).contiguous()
    with torch.no_grad():
        t, s = teacher(batch, pos).log_softmax(-1), student(batch, pos).log_softmax(-1)
    return float(F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean"))


def test_distillation_pulls_the_routers_toward_the_dense_model():
    """At capacity 1 every token routes and only the scores r differ from the dense model's implicit 1. Routers
    started at r = 0.5 (half of every routed layer's update) must learn their way back: the KL to the dense
    model falls and the biases rise toward 1. (On random weights the choice of tokens carries no signal, so this
    is the part of distillation a unit test can check; the real-weights figures are bench/mod_routers.py's.)"""
    weights = random_weights(DENSE)
    opts = RouterTraining(capacity=1.0, steps=15, seq_len=48, batch=4, lr=0.05, init_bias=0.5)
    res = distil(DENSE, weights, IDS, opts, progress=False)
    held = windows(IDS, 48, 4, torch.Generator().manual_seed(99))
    before = _kl(res.cfg, {**weights, **initial_routers(res.cfg, opts.seed, 0.5)}, held)
    after = _kl(res.cfg, {**weights, **res.tensors}, held)
    assert after < 0.5 * before
    for i in (1, 3):
        assert float(res.tensors[f"layers.{i}.router.bias"]) > 0.7
    assert res.routed_fraction == {1: 1.0, 3: 1.0}  # capacity 1: the threshold lets every token through


def test_thresholds_are_calibrated_to_the_capacity():
    res = distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=0.25, steps=3, seq_len=48),
                 progress=False)
    assert set(res.routed_fraction) == {1, 3}
    for frac in res.routed_fraction.values():  # each threshold is its layer's (1 - capacity) score quantile
        assert abs(frac - 0.25) <= 0.02


def test_predictors_beat_a_constant_guess():
    weights = random_weights(DENSE)
    opts = RouterTraining(capacity=0.25, steps=4, seq_len=48, decide="predictor", hidden=32, predictor_steps=200)
    res = distil(DENSE, weights, IDS, opts, progress=False)
    # Layer 1 is the first routed layer: its input is the same in both forms, so the causal graph gives both the
    # predictor's guesses and the router scores whose top-k the predictor was trained to guess.
    gm = build_graph(res.cfg, {**weights, **res.tensors}, mod_form="causal")
    seen = _scores(gm, windows(IDS, 48, 8, torch.Generator().manual_seed(5)))
    label = torch.ops.kiln.mod_topk_mask(seen["layers.1.router.weight"][1], 0.25).flatten()
    guess = (seen["layers.1.router.predictor.fc1.weight"][1] > 0).flatten()
    assert (guess == label).float().mean() > 0.75 + 0.03  # 0.75: always predicting "skip"


def test_flops_count_the_routed_share():
    mats, scores = layer_flops(DENSE, 100)
    hd = DENSE.head_dim
    assert mats == 2 * DENSE.dim * hd * (2 * DENSE.heads + 2 * DENSE.kv_heads) + 2 * DENSE.dim * DENSE.ffn * 3
    assert scores == 4 * 100 * DENSE.heads * hd
    dense = flops_per_token(DENSE, 100)
    assert dense == 2 * DENSE.dim * DENSE.vocab + DENSE.layers * (mats + scores)
    routed = dataclasses.replace(DENSE, route=ModConfig(0.5))
    router = 2 * (2 * DENSE.dim + 2)
    assert flops_per_token(routed, 100, {1: 1.0, 3: 1.0}) == dense + router
    half = flops_per_token(routed, 100, {1: 0.5, 3: 0.5})
    _, half_scores = layer_flops(DENSE, 50)
    assert half == pytest.approx(dense - 2 * (mats + scores) + 2 * (0.5 * mats + 0.5 * half_scores) + router)


def test_training_from_scratch_learns_the_text():
    cfg = dataclasses.replace(DENSE, route=ModConfig(0.5), layers=2)
    res = train_from_scratch(cfg, IDS, ScratchTraining(steps=25, batch=4, seq_len=32, lr=1e-2), progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.5 and math.isfinite(last)
    assert abs(res.routed_fraction[1] - 0.5) <= 0.05
