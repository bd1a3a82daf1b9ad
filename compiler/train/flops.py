"""Forward FLOPs per token of a (possibly routed) model, for the Mixture-of-Depths figures.

A multiply-add counts 2. Per attention site: the q/k/v/o projections and, for a query with `context` visible keys,
4 * context * heads * head_dim for the scores and the weighted sum; per MLP site its two or three matrices; the head
once. A routed layer that takes a fraction f of the tokens does its projections and MLP for those tokens only, and
their attention runs among routed tokens, so each sees about f * context keys: f * (dense) + f^2 * (scores). The
router (and predictor) run on every token. Embedding lookups and norms are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping

from kiln.model_config import AttentionCall, MlpCall, ModelConfig


def layer_flops(cfg: ModelConfig, context: float) -> tuple[float, float]:
    """(FLOPs of one layer's matrices per token, FLOPs of its attention scores per token at `context` keys)."""
    mats = scores = 0.0
    d, hd = cfg.dim, cfg.head_dim
    for site in cfg.sites():
        if isinstance(site, AttentionCall):
            window = site.window or context
            mats += 2 * d * hd * (2 * cfg.heads + 2 * cfg.kv_heads)
            scores += 4 * min(context, window) * cfg.heads * hd
        elif isinstance(site, MlpCall):
            mats += 2 * d * cfg.ffn * (3 if site.gated else 2)
    return mats, scores


def flops_per_token(cfg: ModelConfig, context: float, routed_fraction: Mapping[int, float] | None = None) -> float:
    """Mean forward FLOPs per token when queries see `context` keys on average (a causal window of T tokens:
    (T + 1) / 2). routed_fraction: the measured fraction of tokens each routed layer takes (missing: 1)."""
    routed_fraction = routed_fraction or {}
    mats, _ = layer_flops(cfg, context)
    total = 2.0 * cfg.dim * cfg.vocab  # the head
    for i in range(cfg.layers):
        routed = cfg.route is not None and cfg.route.routed(i)
        f = routed_fraction.get(i, 1.0) if routed else 1.0
        _, scores = layer_flops(cfg, f * context)
        total += f * mats + f * scores
        if routed:
            total += 2 * cfg.dim + 2  # the router score
            if cfg.route.decide == "predictor":
                total += 2 * cfg.dim * cfg.route.hidden + 2 * cfg.route.hidden + 2
    return total
