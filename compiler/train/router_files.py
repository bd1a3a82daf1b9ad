"""Trained routers on disk: one safetensors file of router tensors (kiln names) whose metadata records the routing
(capacity, every, decide, hidden), so a dense checkpoint plus this file is the routed model."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.errors import KilnError, WeightError
from kiln.ir.frontend import build_graph
from kiln.model_config import ModConfig, ModelConfig, param_shapes

log = logging.getLogger("kiln.train")

_KEYS = ("capacity", "every", "decide", "hidden")


def save_routers(path: str | os.PathLike, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write the router tensors of the routed `cfg` (cfg.route set) with the routing in the file's metadata."""
    assert cfg.route is not None, "save_routers needs a routed config"
    meta = {k: str(getattr(cfg.route, k)) for k in _KEYS} | {"model": cfg.name, "format": "kiln-mod-routers"}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().float().contiguous().cpu() for n, t in sorted(tensors.items())}, str(path), meta)
    return path


def load_routers(path: str | os.PathLike) -> tuple[ModConfig, dict[str, torch.Tensor]]:
    return _read(path)[:2]


def check_routers_file(path: str | os.PathLike) -> None:
    """KilnError unless `path` is a readable routers file (a small file: reading it whole is the check)."""
    _read(path)


def _read(path: str | os.PathLike) -> tuple[ModConfig, dict[str, torch.Tensor], str | None]:
    """(routing, router tensors, the name of the model they were trained for) of a routers file."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"routers file {path}: no such file; give the .safetensors file `kiln train-router` wrote")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as e:  # safetensors raises its own errors for a damaged file
        raise WeightError(f"routers file {path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != "kiln-mod-routers":
        raise WeightError(f"routers file {path}: no kiln routing metadata; it was not written by `kiln train-router`")
    try:
        route = ModConfig(float(meta["capacity"]), int(meta["every"]), meta["decide"], int(meta["hidden"]))
    except (KeyError, ValueError) as e:
        raise WeightError(f"routers file {path}: damaged routing metadata ({e}); train the routers again with "
                          "`kiln train-router`") from None
    return route, tensors, meta.get("model")


def attach_routers(cfg: ModelConfig, gm: torch.fx.GraphModule, path: str | os.PathLike,
                   mod_form: str = "causal") -> tuple[ModelConfig, torch.fx.GraphModule]:
    """The routed model from a dense model's graph and a routers file: its config and Level-1 graph."""
    if cfg.route is not None:
        raise KilnError(f"{cfg.name} is already routed (route = mod(...) in its spec); a routers file adds routers to "
                        "a dense model: drop the route setting, or attach no routers")
    route, routers, trained_for = _read(path)
    if trained_for is not None and trained_for != cfg.name:
        # Same shapes are no proof that the routers fit this model's residual stream, but a name is no proof either
        # way (a checkpoint loaded without a spec is named after its folder): say so, and go on.
        log.warning("routers file %s was trained for model %r, not %r: if that is another model, train the routers "
                    "on %s with `kiln train-router`", path, trained_for, cfg.name, cfg.name)
    routed = dataclasses.replace(cfg, route=route)
    want = {n: s for n, s in param_shapes(routed).items() if ".router." in n}
    missing = sorted(set(want) - set(routers))
    wrong = sorted(n for n in want if n in routers and tuple(routers[n].shape) != want[n])
    if missing or wrong:
        raise WeightError(f"routers file {path} does not fit {cfg.name}: missing {missing[:4]}, wrong shape "
                          f"{wrong[:4]}; train the routers on this model with `kiln train-router`")
    params = {n: p.detach() for n, p in gm.named_parameters()}
    if any(p.device.type == "meta" for p in params.values()) or len(params) != len(param_shapes(cfg)):
        raise KilnError(f"routers file {path}: attaching routers needs {cfg.name}'s dense weights in full precision "
                        "(not quantized); load the model without quantization (quantize='none' for a GGUF)")
    ref = next(iter(params.values()))
    weights = params | {n: routers[n].to(ref.device, ref.dtype) for n in want}
    return routed, build_graph(routed, weights, dtype=ref.dtype, device=ref.device, mod_form=mod_form)
