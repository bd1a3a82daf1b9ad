"""kiln.train.router_fit: routers fitted to the dense model's heavy hitters (received attention)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.errors import KilnError
from kiln.ir.frontend import build_graph, random_weights
from kiln.train.router_fit import EPS, fit_router, received_attention
from kiln.train.routers import RouterTraining, _scores, calibration_windows, distil, routed_layers
from tests.support.train_data import DENSE, IDS


@pytest.mark.parametrize("window", [0, 3])
def test_received_attention_equals_a_loop(window):
    gen = torch.Generator().manual_seed(3)
    b, t, heads, kv, d = 2, 7, 4, 2, 5
    q, k = torch.randn(b, t, heads * d, generator=gen), torch.randn(b, t, kv * d, generator=gen)
    got = received_attention(q, k, heads, kv, window, 0.4)
    want = torch.zeros(b, t)
    for s in range(b):
        for h in range(heads):
            g = h // (heads // kv)
            for i in range(t):
                keys = [j for j in range(i + 1) if window == 0 or i - j < window]
                logits = torch.stack([q[s, i, h * d : (h + 1) * d] @ k[s, j, g * d : (g + 1) * d] * 0.4 for j in keys])
                for j, p in zip(keys, torch.softmax(logits, 0), strict=True):
                    want[s, j] += p
    observers = torch.tensor([sum(1 for i in range(t) if i >= j and (window == 0 or i - j < window))
                              for j in range(t)])
    torch.testing.assert_close(got, want / observers)


def test_fit_router_recovers_a_linear_target_at_unit_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(600, 12, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 50, 12, dtype=torch.float64)
    target = x @ torch.randn(12, generator=gen, dtype=torch.float64) + 0.01 * torch.randn(600, generator=gen,
                                                                                          dtype=torch.float64)
    w, b, corr = fit_router(x, target)
    r = (x.float() @ w.t())[:, 0] + b
    assert corr > 0.99
    assert float(torch.corrcoef(torch.stack([r.double(), target]))[0, 1]) > 0.99  # the score orders like the target
    assert abs(float(r.mean()) - 1) < 1e-4 and abs(float(r.std()) - EPS) < 1e-4  # routed updates keep their size


def test_fitted_routers_take_the_capacity_in_every_layer_at_about_unit_scores():
    cfg = dataclasses.replace(DENSE, layers=6)
    weights = random_weights(cfg)
    res = distil(cfg, weights, IDS, RouterTraining(capacity=0.25, steps=0, seq_len=48, calib_windows=16),
                 progress=False)
    assert set(res.fit_correlation) == {"layers.1", "layers.3", "layers.5"}
    assert set(res.routed_fraction) == {1, 3, 5}
    for frac in res.routed_fraction.values():  # thresholds set layer by layer with the earlier ones in place
        assert abs(frac - 0.25) <= 0.02
    gm = build_graph(res.cfg, {**weights, **res.tensors}, mod_form="causal")
    seen = _scores(gm, calibration_windows(IDS, 48, 16))
    for i in routed_layers(res.cfg):
        r = seen[f"layers.{i}.router.weight"][1].flatten()
        assert abs(float(r.mean()) - 1) < 5 * EPS and float(r.std()) < 5 * EPS
        assert float(r.std()) > 0  # the scores are not flat: the threshold has something to order


def test_capacity_one_keeps_flat_routers_and_init_is_checked():
    res = distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=1.0, steps=0, seq_len=48),
                 progress=False)
    assert res.fit_correlation == {}
    assert all(float(res.tensors[f"layers.{i}.router.bias"]) == 1.0 for i in (1, 3))
    with pytest.raises(KilnError, match="init = 'best'"):
        RouterTraining(capacity=0.5, init="best").mod()
