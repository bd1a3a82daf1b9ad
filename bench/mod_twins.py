"""The dense model and its Mixture-of-Depths twin for bench/mod_speed.py: the same random tensors, routers whose
thresholds are calibrated in layer order on the causal form, compiled with the narrowing knobs asked for, and a
step-model wrapper that counts what each routed layer really routed."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator

import torch
from torch import fx

from kiln.compile.step import CompiledStep, compile_step
from kiln.ir.frontend import TORCH_DTYPES, build_graph, random_weights, router_start
from kiln.model_config import ModConfig, ModelConfig
from kiln.passes import kv_cache_routed
from kiln.spec.loader import load_spec

NEVER = 1 << 62  # a NARROW_MIN_ROWS no step reaches: the padded path everywhere


def say(msg: str) -> None:
    print(f"mod_speed: {msg}", file=sys.stderr, flush=True)


def routed_twin(cfg: ModelConfig, capacity: float, every: int) -> ModelConfig:
    return dataclasses.replace(cfg, name=f"{cfg.name}-mod", route=ModConfig(capacity, every, "threshold"))


def router_weights(cfg: ModelConfig, *, seed: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """One router per routed layer of `cfg` (routed): weight N(0, 1/dim), bias as kiln's random init, threshold 0
    until calibrate() sets it."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    bias = router_start(cfg)["bias"]
    out = {}
    for i in range(cfg.layers):
        if cfg.route.routed(i):
            p = f"layers.{i}.router"
            out[f"{p}.weight"] = (torch.randn(1, cfg.dim, generator=gen, device=device) * cfg.dim**-0.5).to(dtype)
            out[f"{p}.bias"] = torch.full((1,), bias, dtype=dtype, device=device)
            out[f"{p}.threshold"] = torch.zeros(1, dtype=dtype, device=device)
    return out


class _Calibrate(fx.Interpreter):
    """Runs the Level-1 causal form; each router's threshold becomes the (1 - capacity) quantile of its scores as
    soon as they exist, before its mask reads the threshold (the parameter is filled in place)."""

    def __init__(self, gm: fx.GraphModule, capacity: float):
        super().__init__(gm)
        self.capacity, self.thresholds = capacity, {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op == "call_function" and n.target is torch.ops.kiln.mod_router.default:
            mask = next(u for u in n.users if u.target is torch.ops.kiln.mod_threshold_mask.default)
            name = mask.args[1].target
            q = float(torch.quantile(out.float().flatten(), 1.0 - self.capacity))
            self.module.get_parameter(name).data.fill_(q)
            self.thresholds[name] = q
        return out


def calibrate(gm: fx.GraphModule, cfg: ModelConfig, prompts: torch.Tensor) -> dict[str, float]:
    """Set every routed layer's threshold on `prompts` [B, T]; returns them by parameter name."""
    run = _Calibrate(gm, cfg.route.capacity)
    pos = torch.arange(prompts.shape[1], device=prompts.device).expand_as(prompts)
    with torch.no_grad():
        run.run(prompts, pos)
    return run.thresholds


class CountRouted:
    """A step model (the wrapped CompiledStep's everything) whose routed rows are counted per routed layer, on the
    device (no extra sync), from what the runner records after each step (watch): a replayed CUDA graph never
    calls the model, and the padding rows of a padded step are never counted."""

    def __init__(self, step: CompiledStep):
        self.step = step
        self.reset()

    def __getattr__(self, name: str):
        return getattr(self.step, name)

    def __call__(self, batch, kv_cache):
        return self.step(batch, kv_cache)

    def reset(self) -> None:
        self.rows, self.routed = 0, None

    def watch(self, block_manager) -> None:
        """Count every step the engine records in `block_manager` (a dense twin's records nothing)."""
        record = getattr(block_manager, "record_step", None)
        if record is None:
            return

        def counted(seqs, routed, plain_decodes: bool = False) -> None:
            real = len(seqs) if plain_decodes else sum(s.num_new for s in seqs)  # rows past them: graph padding
            got = torch.as_tensor(routed)[:, :real].sum(-1, dtype=torch.int64)
            self.routed = got if self.routed is None else self.routed + got
            self.rows += real
            record(seqs, routed, plain_decodes)

        block_manager.record_step = counted

    def fractions(self, layers: list[int]) -> dict[str, float]:
        if self.routed is None or not self.rows:
            return {}
        return {str(i): round(c / self.rows, 4) for i, c in zip(layers, self.routed.tolist(), strict=True)}


@contextlib.contextmanager
def narrow_knobs(min_rows: int, bucket: int) -> Iterator[None]:
    """kv_cache_routed.NARROW_MIN_ROWS / NARROW_BUCKET for the compile_step calls inside (the pass reads them),
    restored after for whoever compiles next in this process."""
    saved = (kv_cache_routed.NARROW_MIN_ROWS, kv_cache_routed.NARROW_BUCKET)
    kv_cache_routed.NARROW_MIN_ROWS, kv_cache_routed.NARROW_BUCKET = min_rows, bucket
    try:
        yield
    finally:
        kv_cache_routed.NARROW_MIN_ROWS, kv_cache_routed.NARROW_BUCKET = saved


def build_twins(spec: str, capacity: float, every: int, dtype: str, device: torch.device, seed: int,
                calib: tuple[int, int], copies: int) -> tuple[list[tuple], dict[str, float]]:
    """([(cfg, compile cfg, Level-1 graph)] of the dense model and `copies` routed ones, the routed thresholds by
    name). Every graph holds the same dense tensors (no copy), the routed ones the same calibrated routers."""
    loaded = load_spec(spec)
    cfg, comp = loaded.model, dataclasses.replace(loaded.compile, dtype=dtype)
    if cfg.route is not None:
        raise SystemExit(f"{spec} is already routed; give its dense form (the routed twin is made here)")
    tdtype = TORCH_DTYPES[dtype]
    weights = random_weights(cfg, seed=seed, dtype=tdtype, device=device)
    rcfg = routed_twin(cfg, capacity, every)
    rcomp = dataclasses.replace(comp, extra={**comp.extra, "route": rcfg.route})
    routers = router_weights(rcfg, seed=seed, dtype=tdtype, device=device)
    rgm = build_graph(rcfg, {**weights, **routers}, dtype=tdtype, device=device)
    gen = torch.Generator().manual_seed(seed + 7)
    thresholds = calibrate(rgm, rcfg, torch.randint(0, cfg.vocab, calib, generator=gen).to(device))
    routers.update({name: torch.full((1,), q, dtype=tdtype, device=device) for name, q in thresholds.items()})
    graphs = [(cfg, comp, build_graph(cfg, weights, dtype=tdtype, device=device)), (rcfg, rcomp, rgm)]
    graphs += [(rcfg, rcomp, build_graph(rcfg, {**weights, **routers}, dtype=tdtype, device=device))
               for _ in range(copies - 1)]
    return graphs, thresholds


def compile_side(cfg: ModelConfig, comp, gm: fx.GraphModule, device: torch.device, knobs: tuple[int, int]
                 ) -> CountRouted:
    kernels = device.type == "cuda"
    t = time.perf_counter()
    with narrow_knobs(*knobs):
        step = compile_step(gm, cfg, comp, device=device, use_kernels=kernels)
    when = "never" if knobs[0] >= NEVER else f"at >= {knobs[0]} rows"
    say(f"{cfg.name}: compile_step {time.perf_counter() - t:.1f} s ({'kernels' if kernels else 'reference ops'}, "
        f"narrowing {when})")
    return CountRouted(step)
