"""Train a small model from scratch on a text, dense or Mixture-of-Depths (its routed twin), with every weight
learning: the paper's setting, at a size a CPU trains in a minute. The routed model trains in the training form
(top-k per sequence) and is then calibrated for the causal form (kiln.train.routers.calibrate)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kiln import env
from kiln.ir.frontend import build_graph
from kiln.model_config import ModelConfig
from kiln.train.differentiable import Differentiable
from kiln.train.routers import RouterResult, calibrate, windows


@dataclass
class ScratchTraining:
    steps: int = 300
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0


@dataclass
class ScratchResult:
    weights: dict[str, torch.Tensor]  # every trained tensor (thresholds calibrated for a routed model)
    losses: list[float] = field(default_factory=list)  # training cross-entropy per step
    routed_fraction: dict[int, float] = field(default_factory=dict)


def train_from_scratch(cfg: ModelConfig, ids: Sequence[int], opts: ScratchTraining,
                       progress: bool | None = None) -> ScratchResult:
    """Next-token cross-entropy with Adam (cosine decay) on random windows of `ids`; cfg.route decides dense/MoD.
    progress: a bar on stderr; None: on unless TQDM_DISABLE is set (kiln.env.progress_bars)."""
    progress = env.progress_bars() if progress is None else progress
    gen = torch.Generator().manual_seed(opts.seed)
    gm = build_graph(cfg, seed=opts.seed, mod_form="training")  # the top-k form: a dense model ignores it
    params = [p for n, p in gm.named_parameters() if not n.endswith("threshold")]
    for p in gm.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, opts.steps)
    run = Differentiable(gm)
    losses = []
    from tqdm import tqdm  # lazy: progress only

    desc = f"kiln: train {cfg.name}" + (f" c={cfg.route.capacity}" if cfg.route else " dense")
    for _ in tqdm(range(opts.steps), desc=desc, file=sys.stderr, disable=not progress):
        batch = windows(ids, opts.seq_len + 1, opts.batch, gen)
        logits = run.forward(batch[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in gm.named_parameters()}
    result = ScratchResult(weights, losses)
    if cfg.route is not None:
        routers = RouterResult(cfg, {n: t for n, t in weights.items() if ".router." in n})
        calibrate(routers, weights, windows(ids, opts.seq_len, max(opts.batch, 8), gen))
        weights.update(routers.tensors)
        result.routed_fraction = routers.routed_fraction
    return result
