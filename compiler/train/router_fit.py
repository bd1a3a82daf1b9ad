"""Fit Mixture-of-Depths routers to the dense model's heavy hitters: where router distillation starts.

A routed layer's skipped tokens write no K/V there, so its routed tokens attend among themselves only. In a
pretrained model a few tokens take most of each layer's attention (the first tokens as attention sinks, then
punctuation and other hubs: the "heavy hitters" of Zhang et al., 2023, H2O). Dropping one of them changes every
routed query's attention, while dropping a token nobody attends to only costs that token its own update. So each
routed layer's router is fitted, by ridge regression on the layer's input x, to log of the attention the token
receives in the dense model (per query that can see it, summed over heads), and the top capacity share of
predicted scores is routed.

The score also scales the routed token's update (kiln.ir.ops_mod: x + r * (block(x) - x)), so the fitted router
is r = 1 + eps * z with z the prediction standardized over the calibration tokens: routed tokens keep about their
dense update (eps = 0.01: within a few percent) and the threshold orders tokens by z. Layers are fitted in order on
the causal form with the earlier layers already routed, so each fit sees the inputs it will see when served.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.errors import InternalError
from kiln.ir.frontend import build_graph
from kiln.model_config import ModelConfig
from kiln.progress import say
from kiln.train.differentiable import Differentiable

EPS = 0.01  # spread of the fitted scores around 1 (their standard deviation over the calibration tokens)
RIDGE = 1e-2  # ridge penalty per sample on the standardized features
_FLOOR = 1e-4  # received attention below this is noise; keeps log() finite




class _Stop(Exception):
    """Raised by the tap once the layer being fitted has been seen: the layers after it are not needed."""


def received_attention(q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int, window: int,
                       scale: float) -> torch.Tensor:
    """[B, T] attention each key receives in causal attention (window > 0: sliding), summed over heads and averaged
    over the queries that can see it."""
    b, t, _ = q.shape
    d = q.shape[2] // num_heads
    qh = q.float().view(b, t, num_heads, d).transpose(1, 2)
    kh = k.float().view(b, t, num_kv_heads, d).transpose(1, 2).repeat_interleave(num_heads // num_kv_heads, dim=1)
    i = torch.arange(t)
    hidden = i[None, :] > i[:, None]
    if window > 0:
        hidden |= i[:, None] - i[None, :] >= window
    p = torch.softmax(((qh @ kh.transpose(-1, -2)) * scale).masked_fill(hidden, float("-inf")), dim=-1)
    observers = (~hidden).sum(0).clamp(min=1)  # how many queries can see each key
    return p.sum(dim=(1, 2)) / observers


def _layer_stats(gm: fx.GraphModule, calib: torch.Tensor, nth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [N, D], received [N]) at the nth routed layer (0-based) of a causal-form graph, over the calibration
    windows; the forward stops there."""
    run = Differentiable(gm)
    xs: list[torch.Tensor] = []
    got: list[torch.Tensor] = []

    def tap(node: fx.Node, out: torch.Tensor) -> None:
        name = node.target._schema.name
        if name == "kiln::mod_router" and len(xs) == nth:
            xs.append(run.env[node.args[0]].detach())
        elif name == "kiln::mod_router":
            xs.append(None)
        elif name == "kiln::routed_attention" and len(xs) == nth + 1:
            q, k = run.env[node.args[0]].detach(), run.env[node.args[1]].detach()
            got.append(received_attention(q, k, node.args[4], node.args[5], node.args[7], node.args[8]))
            raise _Stop

    run.tap = tap
    try:
        with torch.no_grad():
            run.forward(calib)
    except _Stop:
        pass
    if not got:
        raise InternalError(f"routed layer #{nth} has no kiln::routed_attention after its router")
    x = xs[nth]
    return x.reshape(-1, x.shape[-1]).double(), got[0].flatten().double()


def fit_router(x: torch.Tensor, target: torch.Tensor, eps: float = EPS,
               ridge: float = RIDGE) -> tuple[torch.Tensor, float, float]:
    """(weight [1, D], bias, correlation): r = x @ weight.T + bias = 1 + eps * z, z the ridge prediction of target
    standardized over these rows; correlation: the prediction's with the target on these rows."""
    mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
    a = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    reg = ridge * len(x) * torch.eye(a.shape[1], dtype=x.dtype)
    reg[-1, -1] = 0  # the intercept is not penalized
    coef = torch.linalg.solve(a.T @ a + reg, a.T @ target)
    pred = a @ coef
    z_mu, z_sd = pred.mean(), pred.std().clamp(min=1e-12)
    w = coef[:-1] / sd / z_sd
    b = (coef[-1] - (coef[:-1] * mu / sd).sum() - z_mu) / z_sd
    corr = float(torch.corrcoef(torch.stack([pred, target]))[0, 1]) if target.std() > 0 else 0.0
    return (eps * w).float().view(1, -1), 1.0 + eps * float(b), corr


def fit_routers(cfg: ModelConfig, weights: dict[str, torch.Tensor], routers: dict[str, torch.Tensor],
                calib: torch.Tensor, progress: bool = True) -> dict[str, float]:
    """Fit the routers of routed config `cfg` in place in `routers` (router.weight, router.bias, router.threshold
    per routed layer) on the calibration windows [B, T]; returns each layer's fit correlation by parameter name."""
    layers = [i for i in range(cfg.layers) if cfg.route.routed(i)]
    for i in layers:  # every token routes until its layer is fitted
        routers[f"layers.{i}.router.threshold"] = torch.tensor([float("-inf")])
    corr = {}
    for nth, i in enumerate(layers):
        gm = build_graph(cfg, {**weights, **routers}, mod_form="causal")
        x, received = _layer_stats(gm, calib, nth)
        w, b, corr[f"layers.{i}"] = fit_router(x, torch.log(received + _FLOOR))
        r = (x.float() @ w.t())[:, 0] + b
        routers[f"layers.{i}.router.weight"] = w
        routers[f"layers.{i}.router.bias"] = torch.tensor([b])
        routers[f"layers.{i}.router.threshold"] = torch.quantile(r, 1 - cfg.route.capacity).view(1)
        if progress:
            say(f"router of layer {i} fitted (correlation {corr[f'layers.{i}']:.2f})")
    return corr
