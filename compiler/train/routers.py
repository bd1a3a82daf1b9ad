"""Distil Mixture-of-Depths routers into an existing dense model (every other weight frozen).

1. Routers: init = "fit" (the default below capacity 1) fits each router to the tokens the dense model attends to
   most (kiln.train.router_fit: which tokens to keep is learnt from the teacher's attention); init = "flat" starts
   every score at 1 (weight 0, bias 1: capacity 1 is then exactly the dense model). Then, for `steps` steps, the
   student, the model with `route = mod(capacity, every)` in the training form (top ceil(c * T) tokens per sequence
   by router score, block delta scaled by the score), learns router.weight / router.bias only, by KL divergence to
   the dense teacher's next-token distribution on windows of a text.
2. The causal decider, which generation needs (top-k over a sequence looks ahead):
   - threshold: routed layers in order, each layer's threshold is the (1 - capacity) quantile of its router scores
     on the calibration windows, measured in the causal form with the earlier layers' thresholds already set (so
     each layer sees the inputs it will see when served);
   - predictor: a small MLP on the layer's (detached) input trained with binary cross-entropy to predict the
     training form's top-k membership (Raposo et al., 2024, section 3.5).
The dense weights are never changed; the result is the router tensors, saved next to them by the caller.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from kiln import env
from kiln.errors import KilnError
from kiln.ir.frontend import build_graph
from kiln.model_config import ModConfig, ModelConfig, param_shapes
from kiln.train.differentiable import Differentiable
from kiln.train.router_fit import EPS, fit_routers

_ROUTER = re.compile(r"^layers\.(\d+)\.router\.")


@dataclass
class RouterTraining:
    capacity: float
    every: int = 2
    decide: str = "threshold"  # or "predictor"
    hidden: int = 128  # predictor width
    steps: int = 100  # distillation steps
    batch: int = 4  # windows per step
    seq_len: int = 128  # tokens per window
    lr: float = 3e-3
    predictor_steps: int = 300
    seed: int = 0
    init_bias: float = 1.0  # init = "flat": the routers' starting score (1: at capacity 1, the dense model)
    init: str = "auto"  # "fit" (heavy hitters; kiln.train.router_fit), "flat", or "auto": fit below capacity 1
    calib_windows: int = 32  # windows of seq_len tokens for the fit and the thresholds (fewer if the text is short)

    def mod(self) -> ModConfig:
        if not 0 < self.capacity <= 1:
            raise KilnError(f"capacity = {self.capacity} is out of range; allowed: 0 < capacity <= 1")
        if self.every < 1:
            raise KilnError(f"every = {self.every} is out of range; allowed: an integer >= 1")
        if self.decide not in ("threshold", "predictor"):
            raise KilnError(f"decide = {self.decide!r}: allowed: threshold or predictor")
        if self.init not in ("auto", "fit", "flat"):
            raise KilnError(f"init = {self.init!r}: allowed: auto, fit or flat")
        # Checked here, not where they are used: a bad value would fail deep in torch, or only after the fit.
        for name, lo in (("steps", 0), ("batch", 1), ("seq_len", 2), ("calib_windows", 1), ("predictor_steps", 0)):
            if getattr(self, name) < lo:
                raise KilnError(f"{name} = {getattr(self, name)} is out of range; allowed: an integer >= {lo}")
        if self.decide == "predictor" and self.hidden < 1:
            raise KilnError(f"hidden = {self.hidden} is out of range; the predictor needs a width >= 1")
        if not 0 < self.lr < math.inf:
            raise KilnError(f"lr = {self.lr} is out of range; allowed: a positive number (e.g. 3e-3)")
        return ModConfig(self.capacity, self.every, self.decide, self.hidden if self.decide == "predictor" else 0)


@dataclass
class RouterResult:
    cfg: ModelConfig  # the routed model's config
    tensors: dict[str, torch.Tensor]  # every router tensor by parameter name (fp32, CPU)
    losses: list[float] = field(default_factory=list)  # distillation KL per step
    fit_correlation: dict[str, float] = field(default_factory=dict)  # init = fit: per routed layer (router_fit)
    routed_fraction: dict[int, float] = field(default_factory=dict)  # causal form, per routed layer, calibration text


def initial_routers(cfg: ModelConfig, seed: int = 0, bias: float = 1.0) -> dict[str, torch.Tensor]:
    """Routers that start at the dense model: score exactly 1 for every token (weight 0, bias 1), so at capacity 1
    the student is the dense model and distillation starts from it. (A small random weight would not do: a trained
    model's residual stream is large, so even tiny weights move the scores far from 1.) The predictor's matrices
    are small random, its biases 0."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if not _ROUTER.match(name):
            continue
        if name.endswith("router.bias"):
            out[name] = torch.full(shape, bias)
        elif name.endswith("threshold"):
            out[name] = torch.zeros(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        elif name.endswith("router.weight"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * (0.02 / math.sqrt(shape[1]))
    return out


def windows(ids: Sequence[int], seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len] random windows of the token stream."""
    if len(ids) < seq_len + 1:
        raise KilnError(f"the training text has {len(ids)} tokens; need at least seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=gen)
    stream = torch.as_tensor(ids, dtype=torch.long)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def calibration_windows(ids: Sequence[int], seq_len: int, count: int) -> torch.Tensor:
    """[n, seq_len]: up to `count` consecutive windows from the start of the token stream (at least one)."""
    n = max(1, min(count, len(ids) // seq_len))
    if len(ids) < seq_len:
        raise KilnError(f"the training text has {len(ids)} tokens; need at least seq_len = {seq_len}")
    return torch.as_tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _graph(cfg: ModelConfig, weights: dict[str, torch.Tensor], form: str) -> fx.GraphModule:
    return build_graph(cfg, weights, mod_form=form)


def _train_only_routers(gm: fx.GraphModule) -> None:
    """requires_grad on router.weight / router.bias only: every other weight stays the dense model's."""
    for name, p in gm.named_parameters():
        p.requires_grad_(bool(_ROUTER.match(name)) and name.endswith(("router.weight", "router.bias")))


def distil(cfg: ModelConfig, weights: dict[str, torch.Tensor], ids: Sequence[int], opts: RouterTraining,
           progress: bool | None = None) -> RouterResult:
    """Train the routers of `cfg` (a dense config) routed as `opts` says; returns the router tensors. progress: a
    bar on stderr (and a line per fitted router); None: on unless TQDM_DISABLE is set (kiln.env.progress_bars)."""
    if cfg.route is not None:
        raise KilnError(f"{cfg.name} is already routed; train routers on its dense form")
    progress = env.progress_bars() if progress is None else progress
    mcfg = dataclasses.replace(cfg, route=opts.mod())
    if not routed_layers(mcfg):
        raise KilnError(f"every = {opts.every} routes no layer of {cfg.name} ({cfg.layers} layers, routed: i with "
                        f"(i + 1) % every == 0); give every from 1 to {cfg.layers}")
    gen = torch.Generator().manual_seed(opts.seed)
    teacher = build_graph(cfg, weights)
    routers = initial_routers(mcfg, opts.seed, opts.init_bias)
    calib = calibration_windows(ids, opts.seq_len, opts.calib_windows)
    fitted = opts.init == "fit" or (opts.init == "auto" and opts.capacity < 1)
    corr = {}
    if fitted:  # fitted on the threshold form: a predictor is trained to copy the fitted routers afterwards
        fit_cfg = dataclasses.replace(mcfg, route=dataclasses.replace(mcfg.route, decide="threshold", hidden=0))
        plain = {n: t for n, t in routers.items() if ".predictor." not in n}
        corr = fit_routers(fit_cfg, weights, plain, calib, progress)
        routers |= plain
    student_weights = {**weights, **routers}
    student = _graph(mcfg, student_weights, "training")
    _train_only_routers(student)
    # Fitted scores spread by EPS around 1, so a KL step may move them by a share of that, not by lr itself.
    lr = opts.lr * (EPS if fitted else 1.0)
    opt = torch.optim.Adam(_router_groups(student, windows(ids, opts.seq_len, opts.batch, gen), lr))
    run = Differentiable(student)
    losses = []
    from tqdm import tqdm  # lazy: progress only

    bar = progress and opts.steps > 0  # no empty "0it" bar for the fit alone
    for _ in tqdm(range(opts.steps), desc=f"kiln: routers c={opts.capacity}", file=sys.stderr, disable=not bar):
        batch = windows(ids, opts.seq_len, opts.batch, gen)
        with torch.no_grad():
            target = teacher(batch, _positions(batch)).float().log_softmax(-1)
        logp = run.forward(batch).float().log_softmax(-1)
        loss = F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    trained = {n: p.detach().clone() for n, p in student.named_parameters() if _ROUTER.match(n)}
    if opts.decide == "predictor":
        trained |= _train_predictors(student, calib, opts, gen)
    result = RouterResult(mcfg, trained, losses, corr)
    # Fitted thresholds with no KL step after them are already the sequential quantiles calibrate() would compute.
    calibrate(result, weights, calib, thresholds=not (fitted and opts.steps == 0))
    return result


def _router_groups(student: fx.GraphModule, batch: torch.Tensor, lr: float) -> list[dict]:
    """Adam parameter groups: each router.weight's learning rate divided by dim x the mean |x| of its layer's input.

    Adam moves every element by about lr per step, so a weight step moves the score r = x @ w.T + b by about
    lr * sum(|x|) while a bias step moves it by lr. The residual stream of a trained model is large (SmolLM2's
    elements reach the hundreds), and at one lr for both the scores, which scale the layer's output, swing wildly
    and distillation diverges; scaled, both move r by about lr per step."""
    seen = _scores(student, batch)
    groups = []
    for name, p in student.named_parameters():
        if not p.requires_grad:
            continue
        scale = 1.0
        if name.endswith("router.weight"):
            x = seen[name][0]
            scale = 1.0 / max(float(x.float().abs().mean()) * x.shape[-1], 1e-6)
        groups.append({"params": [p], "lr": lr * scale})
    return groups


def _positions(batch: torch.Tensor) -> torch.Tensor:
    b, t = batch.shape
    return torch.arange(t).expand(b, t).contiguous()


def _scores(gm: fx.GraphModule, batch: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One forward; for each router tensor R that an op takes as an argument (router.weight: the score;
    predictor.fc1.weight: the predictor logit), (that op's first input, its output) keyed by R's name."""
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    run = Differentiable(gm)

    def tap(node: fx.Node, out: torch.Tensor) -> None:
        for a in node.args:
            if isinstance(a, fx.Node) and a.op == "get_attr" and str(a.target).endswith(
                    (".router.weight", ".predictor.fc1.weight")):
                found[str(a.target)] = (run.env[node.args[0]].detach(), out.detach())

    run.tap = tap
    with torch.no_grad():
        run.forward(batch)
    return found


def routed_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.layers) if cfg.route is not None and cfg.route.routed(i)]


def _train_predictors(student: fx.GraphModule, calib: torch.Tensor, opts: RouterTraining,
                      gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per routed layer, fit fc2(silu(fc1(x))) to the top-k membership of its router scores (BCE)."""
    seen = _scores(student, calib)
    out: dict[str, torch.Tensor] = {}
    for name, (x, r) in seen.items():
        if not name.endswith(".router.weight"):
            continue
        p = name[: -len("weight")] + "predictor."
        label = torch.ops.kiln.mod_topk_mask(r, opts.capacity).flatten().float()
        feats = x.reshape(label.shape[0], -1).float()
        fc1 = torch.nn.Linear(feats.shape[1], opts.hidden)
        fc2 = torch.nn.Linear(opts.hidden, 1)
        with torch.no_grad():
            for lin in (fc1, fc2):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * lin.in_features ** -0.5)
                lin.bias.zero_()
        opt = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()], lr=opts.lr)
        for _ in range(opts.predictor_steps):
            logit = fc2(F.silu(fc1(feats))).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logit, label)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for lin, tag in ((fc1, "fc1"), (fc2, "fc2")):
            out[f"{p}{tag}.weight"] = lin.weight.detach().clone()
            out[f"{p}{tag}.bias"] = lin.bias.detach().clone()
    return out


def calibrate(result: RouterResult, weights: dict[str, torch.Tensor], calib: torch.Tensor,
              thresholds: bool = True) -> None:
    """Set each routed layer's threshold (decide = threshold) in layer order on the causal form, and record the
    fraction of calibration tokens each routed layer takes when served."""
    cfg = result.cfg
    gm = _graph(cfg, {**weights, **result.tensors}, "causal")
    layers = routed_layers(cfg)
    if cfg.route.decide == "threshold" and thresholds:
        for i in layers:  # layer i's scores depend only on the layers before it, whose thresholds are set
            name = f"layers.{i}.router.weight"
            r = _scores(gm, calib)[name][1].flatten()
            q = torch.quantile(r.float(), 1 - cfg.route.capacity) if cfg.route.capacity < 1 else r.min() - 1
            gm.get_parameter(f"layers.{i}.router.threshold").data.fill_(float(q))
            result.tensors[f"layers.{i}.router.threshold"] = torch.tensor([float(q)])
    seen = _scores(gm, calib)
    for i in layers:
        if cfg.route.decide == "threshold":
            r = seen[f"layers.{i}.router.weight"][1]
            result.routed_fraction[i] = float((r > result.tensors[f"layers.{i}.router.threshold"]).float().mean())
        else:
            logit = seen[f"layers.{i}.router.predictor.fc1.weight"][1]
            result.routed_fraction[i] = float((logit > 0).float().mean())
