"""SpecFile AST -> (ModelConfig, CompileConfig).

Validation never stops at the first problem: every check records a Diagnostic at the offending node and
carries on with a placeholder, and resolve() raises one SpecError holding them all.

Sizes have upper bounds from what kiln can build (SIZE_LIMITS): head_dim from the attention kernels, the rest
far above any released model but low enough that shapes, kernel grids and compile time stay sane. On top of
them the whole model is refused above MAX_WEIGHT_BYTES of weights in its compile dtype: 1 TiB is more than
any single accelerator holds (the largest has 141 GB) and more than hosts kiln runs on have as RAM, so such a
spec could only fail later, after minutes of allocation. `kiln check` reports the size of every spec it accepts.
"""

from __future__ import annotations

import dataclasses

from kiln.errors import SpecError
from kiln.model_config import (
    DTYPE_BYTES,
    GATED_ACTS,
    PLAIN_ACTS,
    AttentionCall,
    CompileConfig,
    LayerAssign,
    LayerExpr,
    MlpCall,
    ModelConfig,
    NormCall,
    NormConfig,
    RopeConfig,
    RopeScaling,
    Var,
    param_shapes,
)
from kiln.model_config import Add as AddExpr
from kiln.spec.ast import Assign, BinOp, Call, Expr, LayerBlock, ModelBlock, Name, Setting, SpecFile
from kiln.spec.compile_keys import COMPILE_KEYS, PLANNED_COMPILE_KEYS, compile_config
from kiln.spec.formatter import format_expr
from kiln.spec.route import describe_route, route_setting
from kiln.spec.values import _bool, _config_call, _enum, _float, _int, _kwargs, _Report, _suggest, _unique

__all__ = ["COMPILE_KEYS", "MAX_WEIGHT_BYTES", "MODEL_KEYS", "PLANNED_COMPILE_KEYS", "SIZE_LIMITS", "describe_route",
           "param_count", "resolve"]

SIZE_KEYS = ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "ffn", "context")
MODEL_KEYS = (*SIZE_KEYS, "norm", "rope", "positions", "tie_embeddings", "final_norm", "route")
REQUIRED = {"vocab": "32000", "dim": "4096", "layers": "32", "heads": "32", "context": "8192",
            "norm": "rms(eps = 1e-5)"}
ACTS = GATED_ACTS + PLAIN_ACTS
_BIG = "far above any released model; check the number"
SIZE_LIMITS = {  # key -> (largest value, why)
    "vocab": (1 << 24, _BIG), "dim": (1 << 17, _BIG), "layers": (1024, _BIG + " (layers also bound compile time)"),
    "heads": (1024, _BIG), "kv_heads": (1024, _BIG), "ffn": (1 << 20, _BIG), "context": (1 << 24, _BIG),
    "head_dim": (256, "the attention kernels take head_dim up to 256 (e.g. 64, 80, 96, 128, 256)"),
    "window": (1 << 24, "window is at most the largest context, 16777216"),
    "original": (1 << 24, "original is a context length: at most 16777216"),
}
FLOAT_LIMITS = {  # key -> (largest value, why): beyond these the fp32 arithmetic overflows or means nothing
    "eps": (1.0, "eps keeps the norm's division finite and is tiny, e.g. eps = 1e-5"),
    "theta": (1e12, "rope theta is a base wavelength, e.g. 10000 or 500000; larger ones overflow in fp32"),
    "factor": (1e6, "rope scaling factors are small ratios, e.g. factor = 8"),
}
MAX_WEIGHT_BYTES = 1 << 40  # 1 TiB; see the module docstring
POSITIONS = ("rope", "learned", "none")
LAYER_OPS = {"norm": (), "attention": ("causal", "window", "bias", "qkv_bias", "out_bias", "rope", "qk_norm"),
             "mlp": ("act", "bias")}
QK_NORMS = ("rms",)  # attention(qk_norm = rms): a per-head RMSNorm of q and k before rope (Qwen3)
_SITE_PREFIX = {"norm": "norm", "attention": "attn", "mlp": "mlp"}


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


# ---- the layer block -------------------------------------------------------------------------------------


class _Layer:
    """Resolves the layer body to the layer program, naming sites innermost argument first, left to right."""

    def __init__(self, r: _Report, positions: str = "rope"):
        self.r, self.defined, self.counts, self.uses_mlp = r, {"x"}, {"norm": 0, "attn": 0, "mlp": 0}, False
        self.positions = positions
        self.unread: dict[str, Assign] = {}  # name -> its latest assignment, while nothing has read it

    def body(self, block: LayerBlock) -> tuple[LayerAssign, ...]:
        out = []
        x_lines = [i for i, stmt in enumerate(block.body) if stmt.target == "x"]
        for i, stmt in enumerate(block.body):
            value = self.expr(stmt.value)
            # An assignment nobody reads builds ops whose weights become required checkpoint tensors for nothing
            # (and dead graph nodes): refuse it where it is written.
            dead = self.unread.pop(stmt.target, None)
            if dead is not None:
                self._unused(dead)
            if x_lines and i < x_lines[-1]:  # later names (or all, with no `x`) are refused below, as not reaching `x`
                self.unread[stmt.target] = stmt
            self.defined.add(stmt.target)
            if value is not None:
                out.append(LayerAssign(stmt.target, value))
        for stmt in self.unread.values():
            if stmt.target != "x":
                self._unused(stmt)
        if not x_lines:
            self.r.error(block, "the layer block never assigns `x`",
                         "`x` is the layer's input and output: end with e.g. `x = x + mlp(norm(x), act = swiglu)`")
        elif x_lines[-1] + 1 < len(block.body):
            stmt = block.body[x_lines[-1] + 1]
            self.r.error(stmt, f"`{stmt.target}` is assigned after the last assignment to `x` and never reaches "
                         "the layer's output", "end the layer block with an assignment to `x`")
        return tuple(out)

    def _unused(self, stmt: Assign) -> None:
        self.r.error(stmt, f"`{stmt.target}` is assigned but never used",
                     f"use `{stmt.target}` in a later line, or remove the assignment (its weights would be loaded "
                     "for nothing)")

    def expr(self, e: Expr) -> LayerExpr | None:
        if isinstance(e, Name):
            if e.id in self.defined:
                self.unread.pop(e.id, None)
                return Var(e.id)
            self.r.error(e, f"undefined name `{e.id}` in the layer block{_suggest(e.id, self.defined)}",
                         "a name must be assigned before it is used; `x` is the layer's input")
            return None
        if isinstance(e, BinOp):
            left, right = self.expr(e.left), self.expr(e.right)
            if e.op != "+":
                self.r.error(e, f"operator `{e.op}` is not supported in the layer block",
                             "values combine with `+` only (residual adds)")
                return None
            return AddExpr(left, right) if left is not None and right is not None else None
        if isinstance(e, Call):
            return self.call(e)
        self.r.error(e, f"{format_expr(e)} cannot be a value in the layer block",
                     "layer values are names, norm(...), attention(...), mlp(...) and `+`")
        return None

    def call(self, c: Call) -> LayerExpr | None:
        args = [self.expr(a) for a in c.args]  # resolved first: inner calls get the lower site numbers
        if c.func not in LAYER_OPS:
            self.r.error(c, f"unknown layer op `{c.func}`{_suggest(c.func, LAYER_OPS)}",
                         "the layer block calls norm(), attention() and mlp()")
            return None
        if len(c.args) != 1:
            self.r.error(c, f"{c.func}() takes exactly one positional argument (its input), got {len(c.args)}",
                         f"e.g. {c.func}(x)")
        kw = _kwargs(self.r, c, LAYER_OPS[c.func], ("act",) if c.func == "mlp" else ())
        prefix = _SITE_PREFIX[c.func]
        site = f"{prefix}{self.counts[prefix]}"
        self.counts[prefix] += 1
        vals = {k: _int(self.r, v, k, *SIZE_LIMITS[k]) if k == "window"
                else _qk_norm(self.r, v) if k == "qk_norm" else _bool(self.r, v, k)
                for k, v in kw.items() if k != "act"}
        if vals.get("causal") is False:  # the torch.compile backend builds non-causal kiln::attention itself
            self.r.error(kw["causal"], "attention(causal = false) cannot be served: kiln generates left to right "
                         "over a KV cache, and a cached token cannot attend to tokens that come after it",
                         "drop `causal = false` (attention is causal by default)")
            vals["causal"] = None
        if vals.get("rope") is True and self.positions != "rope":
            self.r.error(kw["rope"], "attention(rope = true) but the model has no rotary embedding "
                         f"(positions = {self.positions})",
                         "add e.g. `rope = rope(theta = 10000)` to the model block, or drop `rope = true`")
            vals["rope"] = None
        if c.func == "mlp":
            self.uses_mlp = True
            vals["act"] = _enum(self.r, kw["act"], "act", "activation", ACTS) if "act" in kw else None
        if len(args) != 1 or args[0] is None or None in vals.values():
            return None
        if c.func == "norm":
            return NormCall(args[0], site)
        if c.func == "mlp":
            return MlpCall(args[0], site, vals["act"], vals.get("bias", False))
        bias = vals.get("bias", False)
        return AttentionCall(args[0], site, vals.get("causal", True), vals.get("window"),
                             vals.get("qkv_bias", bias), vals.get("out_bias", bias), vals.get("rope", True),
                             vals.get("qk_norm"))


def _qk_norm(r: _Report, e: Expr) -> str | None:
    """attention(qk_norm = rms): the kind alone; its eps is the model norm's, as in Qwen3's checkpoints."""
    hint = ("`qk_norm = rms` normalizes each head of q and k before rope (weights [head_dim], the model norm's "
            "eps); leave it out for no q/k norm")
    if isinstance(e, Call) and e.func in QK_NORMS:
        r.error(e, f"qk_norm = {e.func} takes no arguments: the q/k norm uses the eps of the model's `norm`", hint)
        return None
    if isinstance(e, Name) and e.id in QK_NORMS:
        return e.id
    if isinstance(e, Name):
        r.error(e, f"unknown qk_norm `{e.id}`{_suggest(e.id, QK_NORMS)}", hint)
    else:
        r.error(e, f"qk_norm must be {' or '.join(QK_NORMS)}, got {format_expr(e)}", hint)
    return None


def _walk(body: tuple[LayerAssign, ...]):
    """Every call in the layer program, outermost first."""
    stack: list[LayerExpr] = [a.value for a in body]
    while stack:
        e = stack.pop()
        yield e
        if isinstance(e, AddExpr):
            stack += [e.left, e.right]
        elif not isinstance(e, Var):
            stack.append(e.arg)


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
    layer = _Layer(r, positions or "rope")
    body = layer.body(layer_blocks[0]) if layer_blocks else ()
    rotated = positions == "rope" and any(isinstance(e, AttentionCall) and e.rope for e in _walk(body))
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


def param_count(model: ModelConfig) -> int:
    """Parameters of the model, counted from one layer (the model itself may have up to 1024)."""
    def count(cfg: ModelConfig) -> int:
        total = 0
        for shape in param_shapes(cfg).values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    dense = dataclasses.replace(model, route=None)
    outside = count(dataclasses.replace(dense, layers=0))
    total = outside + model.layers * (count(dataclasses.replace(dense, layers=1)) - outside)
    if model.route is not None:  # a routed layer adds its router (and predictor) tensors
        every = model.route.every
        one = dataclasses.replace(model, layers=every)
        routed = sum(model.route.routed(i) for i in range(model.layers))
        total += routed * (count(one) - count(dataclasses.replace(dense, layers=every)))
    return total


def format_count(n: int) -> str:
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
