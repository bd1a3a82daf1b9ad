"""SpecFile AST -> (ModelConfig, CompileConfig).

Validation never stops at the first problem: every check records a Diagnostic at the offending node and
carries on with a placeholder, and resolve() raises one SpecError holding them all. The layer block is resolved
in kiln.spec.layer_block; the bounds on sizes and values (and on a whole model's weights) live in kiln.spec.limits.
"""

from __future__ import annotations

from kiln.errors import SpecError
from kiln.model_config import (
    DTYPE_BYTES,
    AttentionCall,
    CompileConfig,
    ModelConfig,
    NormConfig,
    RopeConfig,
    RopeScaling,
)
from kiln.spec.ast import Expr, LayerBlock, ModelBlock, Setting, SpecFile
from kiln.spec.compile_keys import COMPILE_KEYS, PLANNED_COMPILE_KEYS, compile_config
from kiln.spec.layer_block import LayerResolver, walk_layer
from kiln.spec.limits import FLOAT_LIMITS, MAX_WEIGHT_BYTES, SIZE_LIMITS, format_bytes, format_count, param_count
from kiln.spec.route import describe_route, route_setting
from kiln.spec.values import _bool, _config_call, _enum, _float, _int, _Report, _unique

__all__ = ["COMPILE_KEYS", "MAX_WEIGHT_BYTES", "MODEL_KEYS", "PLANNED_COMPILE_KEYS", "SIZE_LIMITS", "describe_route",
           "param_count", "resolve"]

SIZE_KEYS = ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "ffn", "context")
MODEL_KEYS = (*SIZE_KEYS, "norm", "rope", "positions", "tie_embeddings", "final_norm", "route")
REQUIRED = {"vocab": "32000", "dim": "4096", "layers": "32", "heads": "32", "context": "8192",
            "norm": "rms(eps = 1e-5)"}
POSITIONS = ("rope", "learned", "none")


def _norm(r: _Report, e: Expr) -> NormConfig | None:
    found = _config_call(r, e, "norm", {"rms": ("eps",), "layer": ("eps",)}, "rms(eps = 1e-5)")
    if found is None:
        return None
    func, kw = found
    eps = _float(r, kw["eps"], "eps", *FLOAT_LIMITS["eps"]) if "eps" in kw else 1e-5
    return NormConfig(func, eps) if eps is not None else None


def _rope(r: _Report, e: Expr) -> RopeConfig | None:
    found = _config_call(r, e, "rope", {"rope": ("theta", "scaling")}, "rope(theta = 10000)")
    if found is None:
        return None
    _, kw = found
    if "theta" not in kw:
        r.error(e, "rope() needs `theta = ...`", "e.g. rope = rope(theta = 10000)")
    theta = _float(r, kw["theta"], "theta", *FLOAT_LIMITS["theta"]) if "theta" in kw else None
    scaling = None
    if "scaling" in kw:
        funcs = {"llama3": ("factor", "low", "high", "original"), "linear": ("factor",)}
        example = "llama3(factor = 8, low = 1, high = 4, original = 8192)"
        sfound = _config_call(r, kw["scaling"], "scaling", funcs, example)
        if sfound is None:
            return None
        kind, skw = sfound
        if "factor" not in skw:
            r.error(kw["scaling"], f"{kind}() needs `factor = ...`", f"e.g. scaling = {kind}(factor = 8)")
            return None
        vals = {k: _float(r, skw[k], k, *FLOAT_LIMITS["factor"]) for k in ("factor", "low", "high") if k in skw}
        original = _int(r, skw["original"], "original", *SIZE_LIMITS["original"]) if "original" in skw else 8192
        if None in vals.values() or original is None:
            return None
        scaling = RopeScaling(kind, vals["factor"], vals.get("low", 1.0), vals.get("high", 4.0), original)
    return RopeConfig(theta, scaling) if theta is not None else None


# ---- blocks ----------------------------------------------------------------------------------------------


def _model(r: _Report, block: ModelBlock) -> ModelConfig | None:
    s = _unique(r, [i for i in block.items if isinstance(i, Setting)], "model setting", MODEL_KEYS)
    if not block.name.strip():  # the name is the served model id and appears in every load line
        r.error(block, "the model name is empty", 'name the model, e.g. model "my-llama" { ... }')
    elif not block.name.isprintable():
        r.error(block, f"the model name {block.name!r} contains a control character (a newline, tab, ...)",
                'use a one-line name of printable characters, e.g. model "my-llama" { ... }')
    for key, example in REQUIRED.items():
        if key not in s:
            r.error(block, f"model `{block.name}` is missing the required setting `{key}`",
                    f"add `{key} = {example}` to the model block")
    ints = {k: _int(r, s[k].value, k, *SIZE_LIMITS[k]) for k in SIZE_KEYS if k in s}
    norm = _norm(r, s["norm"].value) if "norm" in s else None
    rope = _rope(r, s["rope"].value) if "rope" in s else None
    flags = {k: _bool(r, s[k].value, k) for k in ("tie_embeddings", "final_norm") if k in s}

    positions = "rope" if "rope" in s else "none"
    if "positions" in s:
        positions = _enum(r, s["positions"].value, "positions", "positions kind", POSITIONS)
        if positions == "rope" and "rope" not in s:
            r.error(s["positions"], "positions = rope needs a rope setting",
                    "add e.g. `rope = rope(theta = 10000)`, or set positions = learned or none")
        elif positions in ("learned", "none") and "rope" in s:
            r.error(s["positions"], f"rope is set but positions = {positions}",
                    "remove the rope setting, or set positions = rope")

    heads, dim = ints.get("heads"), ints.get("dim")
    kv_heads = ints.get("kv_heads") if "kv_heads" in s else heads
    if heads and kv_heads and heads % kv_heads:
        r.error(s["kv_heads"], f"heads ({heads}) must be divisible by kv_heads ({kv_heads})",
                "each key/value head serves heads / kv_heads query heads: pick a kv_heads that divides heads")
    head_dim = ints.get("head_dim")
    if "head_dim" not in s and heads and dim:
        if dim % heads:
            r.error(s["dim"], f"dim ({dim}) must equal heads ({heads}) * head_dim",
                    "set head_dim explicitly to decouple head size from dim")
        head_dim = dim // heads
        hi, why = SIZE_LIMITS["head_dim"]
        if head_dim > hi:
            r.error(s["dim"], f"dim / heads = {head_dim} is the head size, above the largest kiln supports, {hi}",
                    f"{why}: raise heads, or set head_dim explicitly")

    layer_blocks = [i for i in block.items if isinstance(i, LayerBlock)]
    if not layer_blocks:
        r.error(block, f"model `{block.name}` has no layer block",
                "add `layer { x = x + attention(norm(x))  x = x + mlp(norm(x), act = swiglu) }`")
    for extra in layer_blocks[1:]:
        r.error(extra, f"a second layer block (the first is on line {layer_blocks[0].span.line})",
                "a model has exactly one layer block: merge them")
    layer = LayerResolver(r, positions or "rope")
    body = layer.body(layer_blocks[0]) if layer_blocks else ()
    rotated = positions == "rope" and any(isinstance(e, AttentionCall) and e.rope for e in walk_layer(body))
    if rotated and head_dim and head_dim % 2:  # rotate-half pairs element i with i + head_dim / 2
        where = s["head_dim"] if "head_dim" in s else s["dim"]
        r.error(where, f"rope needs an even head_dim, but head_dim is {head_dim}"
                + ("" if "head_dim" in s else f" (dim {dim} / heads {heads})"),
                f"rotary embeddings rotate pairs of features: pick an even head_dim, e.g. head_dim = {head_dim + 1}")
    route = route_setting(r, s["route"], ints.get("layers")) if "route" in s else None
    if layer.uses_mlp and "ffn" not in s:
        r.error(block, f"model `{block.name}` is missing the setting `ffn`, which mlp() needs",
                "add `ffn = <hidden size of the MLP>` to the model block")
    if r.diags:
        return None
    return ModelConfig(
        name=block.name, vocab=ints["vocab"], dim=dim, layers=ints["layers"], heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn=ints.get("ffn", 0), context=ints["context"], norm=norm, body=body, rope=rope,
        positions=positions, tie_embeddings=flags.get("tie_embeddings", False),
        final_norm=flags.get("final_norm", True), route=route,
    )


def resolve(spec: SpecFile) -> tuple[ModelConfig, CompileConfig]:
    """Validate `spec` and resolve it; raises one SpecError listing every problem found."""
    r = _Report(spec)
    model = _model(r, spec.model)
    comp = compile_config(r, spec.compile, model.layers if model is not None else None)
    if model is not None:
        size = param_count(model) * DTYPE_BYTES[comp.dtype]
        if size > MAX_WEIGHT_BYTES:
            r.error(spec.model, f"model `{model.name}` has {format_count(param_count(model))} parameters, "
                    f"{format_bytes(size)} in {comp.dtype}: above the {format_bytes(MAX_WEIGHT_BYTES)} of weights "
                    "any one device can hold", "make it smaller (layers, dim, ffn, vocab)"
                    + (", or set `dtype = bf16` in the compile block (half the bytes)" if comp.dtype == "fp32" else ""))
    if r.diags or model is None:
        raise SpecError(r.diags)
    if model.route is not None:  # a routed model's graph needs the mod_routing pass (kiln.compile.pipeline)
        comp.extra["route"] = model.route
    return model, comp
