"""The model key `route = mod(capacity = 0.125, every = 2, decide = threshold | predictor(hidden = 128))`.

Mixture-of-Depths routing (kiln.model_config.ModConfig has the semantics): checked here with every problem
reported at its node, like the rest of validation (validate.py calls route_setting).
"""

from __future__ import annotations

from kiln.model_config import ModConfig, ModelConfig
from kiln.spec.ast import Expr, Num, Setting
from kiln.spec.formatter import format_expr
from kiln.spec.values import _config_call, _int, _Report

_HIDDEN_LIMIT = (1 << 17, "hidden is the router predictor's width, a small MLP: e.g. hidden = 128")


def route_setting(r: _Report, setting: Setting, layers: int | None) -> ModConfig | None:
    """The ModConfig of a `route = ...` setting, or None (problems reported). Routed layers need causal attention,
    which the layer block already guarantees (validate.py refuses causal = false)."""
    return _mod(r, setting.value, layers)


_ROUTE_EXAMPLE = "mod(capacity = 0.125, every = 2, decide = threshold)"


def _mod(r: _Report, e: Expr, layers: int | None) -> ModConfig | None:
    """`route = mod(capacity = 0.125, every = 2, decide = threshold | predictor(hidden = 128))` -> ModConfig."""
    found = _config_call(r, e, "route", {"mod": ("capacity", "every", "decide")}, _ROUTE_EXAMPLE)
    if found is None:
        return None
    _, kw = found
    capacity = None
    if "capacity" not in kw:
        r.error(e, "mod() needs `capacity = ...`", f"capacity is the fraction of tokens a routed layer processes, "
                f"in (0, 1]: e.g. route = {_ROUTE_EXAMPLE}")
    else:
        c = kw["capacity"]
        if isinstance(c, Num) and not isinstance(c.value, bool) and 0 < c.value <= 1:
            capacity = float(c.value)
        else:
            r.error(c, f"capacity must be a number in (0, 1], got {format_expr(c)}",
                    "capacity is the fraction of tokens a routed layer processes, e.g. capacity = 0.125")
    every = 2
    if "every" in kw:
        v = kw["every"]
        every = _int(r, v, "every")
        if every is not None and layers and every > layers:
            r.error(v, f"every = {every} is above layers ({layers}), so no layer would be routed",
                    f"every = N routes layers N-1, 2N-1, ...: use every <= {layers}, e.g. every = 2")
            every = None
    decide, hidden = "threshold", 0
    if "decide" in kw:
        dfound = _config_call(r, kw["decide"], "decide", {"threshold": (), "predictor": ("hidden",)},
                              "predictor(hidden = 128)")
        decide = dfound[0] if dfound is not None else None
        if decide == "predictor":
            if "hidden" not in dfound[1]:
                r.error(kw["decide"], "predictor() needs `hidden = ...`",
                        "hidden is the width of the predictor MLP: e.g. decide = predictor(hidden = 128)")
                hidden = None
            else:
                hidden = _int(r, dfound[1]["hidden"], "hidden", *_HIDDEN_LIMIT)
    if capacity is None or every is None or decide is None or hidden is None:
        return None
    return ModConfig(capacity=capacity, every=every, decide=decide, hidden=hidden)


def describe_route(model: ModelConfig) -> str:
    """The routed layers in words (kiln check, kiln compile), or "" for a dense model."""
    route = model.route
    if route is None:
        return ""
    layers = [i for i in range(model.layers) if route.routed(i)]
    shown = ", ".join(map(str, layers[:8])) + (f", ... ({len(layers)} in all)" if len(layers) > 8 else "")
    decide = "threshold" if route.decide == "threshold" else f"predictor(hidden = {route.hidden})"
    return f"Mixture-of-Depths routes layers {shown} (capacity {route.capacity:g}, decide = {decide})"
