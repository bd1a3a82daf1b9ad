"""SpecFile AST -> (ModelConfig, CompileConfig).

Validation never stops at the first problem: every check records a Diagnostic at the offending node and
carries on with a placeholder, and resolve() raises one SpecError holding them all.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from kiln.errors import Diagnostic, SpecError
from kiln.formatter import format_expr
from kiln.model_config import (
    DTYPES,
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
)
from kiln.model_config import Add as AddExpr
from kiln.parser import source_line
from kiln.spec_ast import (
    BinOp,
    Bool,
    Call,
    CompileBlock,
    Expr,
    LayerBlock,
    ModelBlock,
    Name,
    Num,
    Setting,
    SpecFile,
    Str,
)

SIZE_KEYS = ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "ffn", "context")
MODEL_KEYS = (*SIZE_KEYS, "norm", "rope", "positions", "tie_embeddings", "final_norm")
REQUIRED = {"vocab": "32000", "dim": "4096", "layers": "32", "heads": "32", "context": "8192",
            "norm": "rms(eps = 1e-5)"}
COMPILE_KEYS = ("dtype", "quantize")
PLANNED_COMPILE_KEYS = ("kv_cache", "attention", "routing", "speculation")
ACTS = GATED_ACTS + PLAIN_ACTS
POSITIONS = ("rope", "learned", "none")
LAYER_OPS = {"norm": (), "attention": ("causal", "window", "bias", "qkv_bias", "out_bias", "rope"),
             "mlp": ("act", "bias")}
_SITE_PREFIX = {"norm": "norm", "attention": "attn", "mlp": "mlp"}


class _Report:
    def __init__(self, spec: SpecFile):
        self.spec, self.diags = spec, []

    def error(self, node, message: str, hint: str = "") -> None:
        line, col = node.span.line, node.span.column
        self.diags.append(Diagnostic(self.spec.path, line, col, message, hint, source_line(self.spec.source, line)))


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _unique(r: _Report, settings, what: str, known, planned=()) -> dict[str, Setting]:
    """Known settings by key; duplicates, reserved and unknown keys are reported."""
    seen: dict[str, Setting] = {}
    for s in settings:
        if s.key in seen:
            r.error(s, f"duplicate {what} `{s.key}` (first set on line {seen[s.key].span.line})",
                    "remove one of the two")
        elif s.key in planned:
            r.error(s, f"`{s.key}` is not implemented yet by this kiln version", "remove it from the compile block")
        elif s.key not in known:
            r.error(s, f"unknown {what} `{s.key}`{_suggest(s.key, known)}", f"{what}s are: {', '.join(known)}")
        else:
            seen[s.key] = s
    return seen


# ---- values ----------------------------------------------------------------------------------------------


def _int(r: _Report, e: Expr, name: str) -> int | None:
    if isinstance(e, Num) and type(e.value) is int and e.value > 0:
        return e.value
    if name == "window":
        hint = "window is how many recent positions each query sees, itself included; omit it for full attention"
    elif isinstance(e, Num) and type(e.value) is int:
        hint = f"{name} counts something, so it is at least 1"
    else:
        hint = f"write a whole number, e.g. {name} = 8"
    r.error(e, f"{name} must be a positive integer, got {format_expr(e)}", hint)
    return None


def _float(r: _Report, e: Expr, name: str) -> float | None:
    if isinstance(e, Num) and not isinstance(e.value, bool) and e.value > 0:
        return float(e.value)
    r.error(e, f"{name} must be a positive number, got {format_expr(e)}", f"e.g. {name} = 1e-5 or {name} = 10000")
    return None


def _bool(r: _Report, e: Expr, name: str) -> bool | None:
    if isinstance(e, Bool):
        return e.value
    r.error(e, f"{name} must be true or false, got {format_expr(e)}", f"write {name} = true or {name} = false")
    return None


def _enum(r: _Report, e: Expr, name: str, label: str, choices) -> str | None:
    if isinstance(e, Name) and e.id in choices:
        return e.id
    hint = f"{name} is one of: {', '.join(choices)}"
    if isinstance(e, Name):
        r.error(e, f"unknown {label} `{e.id}`{_suggest(e.id, choices)}", hint)
    else:
        r.error(e, f"{name} must be one of {', '.join(choices)}, got {format_expr(e)}", hint + " (no quotes)")
    return None


def _kwargs(r: _Report, call: Call, allowed, required=()) -> dict[str, Expr]:
    """Keyword arguments of `call` by name; unknown, duplicate and missing ones are reported."""
    out: dict[str, Expr] = {}
    for kw in call.kwargs:
        if kw.name in out:
            r.error(kw, f"duplicate argument `{kw.name}` to {call.func}()", "remove one of the two")
        elif kw.name not in allowed:
            takes = f"{call.func}() takes: {', '.join(allowed)}" if allowed else f"{call.func}() takes no arguments"
            r.error(kw, f"unknown argument `{kw.name}` to {call.func}(){_suggest(kw.name, allowed)}", takes)
        else:
            out[kw.name] = kw.value
    for name in required:
        if name not in out:
            r.error(call, f"{call.func}() needs `{name} = ...`", f"{call.func}() takes: {', '.join(allowed)}")
    return out


def _config_call(r: _Report, e: Expr, name: str, funcs: dict[str, tuple[str, ...]], example: str):
    """A structured value like rms(eps = 1e-5) -> (func, kwargs), or None; a bare name is a call with no args."""
    call = Call(e.id, span=e.span) if isinstance(e, Name) else e
    if not isinstance(call, Call):
        r.error(e, f"{name} must be a call like {example}, got {format_expr(e)}", f"e.g. {name} = {example}")
        return None
    if call.func not in funcs:
        r.error(call, f"unknown {name} `{call.func}`{_suggest(call.func, funcs)}",
                f"{name} is one of: {', '.join(f'{f}(...)' for f in funcs)}")
        return None
    for arg in call.args:
        r.error(arg, f"{call.func}() takes keyword arguments only", f"e.g. {name} = {example}")
    return call.func, _kwargs(r, call, funcs[call.func])


def _norm(r: _Report, e: Expr) -> NormConfig | None:
    found = _config_call(r, e, "norm", {"rms": ("eps",), "layer": ("eps",)}, "rms(eps = 1e-5)")
    if found is None:
        return None
    func, kw = found
    eps = _float(r, kw["eps"], "eps") if "eps" in kw else 1e-5
    return NormConfig(func, eps) if eps is not None else None


def _rope(r: _Report, e: Expr) -> RopeConfig | None:
    found = _config_call(r, e, "rope", {"rope": ("theta", "scaling")}, "rope(theta = 10000)")
    if found is None:
        return None
    _, kw = found
    if "theta" not in kw:
        r.error(e, "rope() needs `theta = ...`", "e.g. rope = rope(theta = 10000)")
    theta = _float(r, kw["theta"], "theta") if "theta" in kw else None
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
        vals = {k: _float(r, skw[k], k) for k in ("factor", "low", "high") if k in skw}
        original = _int(r, skw["original"], "original") if "original" in skw else 8192
        if None in vals.values() or original is None:
            return None
        scaling = RopeScaling(kind, vals["factor"], vals.get("low", 1.0), vals.get("high", 4.0), original)
    return RopeConfig(theta, scaling) if theta is not None else None


# ---- the layer block -------------------------------------------------------------------------------------


class _Layer:
    """Resolves the layer body to the layer program, naming sites innermost argument first, left to right."""

    def __init__(self, r: _Report):
        self.r, self.defined, self.counts, self.uses_mlp = r, {"x"}, {"norm": 0, "attn": 0, "mlp": 0}, False

    def body(self, block: LayerBlock) -> tuple[LayerAssign, ...]:
        out = []
        for stmt in block.body:
            value = self.expr(stmt.value)
            self.defined.add(stmt.target)
            if value is not None:
                out.append(LayerAssign(stmt.target, value))
        x_lines = [i for i, stmt in enumerate(block.body) if stmt.target == "x"]
        if not x_lines:
            self.r.error(block, "the layer block never assigns `x`",
                         "`x` is the layer's input and output: end with e.g. `x = x + mlp(norm(x), act = swiglu)`")
        elif x_lines[-1] + 1 < len(block.body):
            stmt = block.body[x_lines[-1] + 1]
            self.r.error(stmt, f"`{stmt.target}` is assigned after the last assignment to `x` and never reaches "
                         "the layer's output", "end the layer block with an assignment to `x`")
        return tuple(out)

    def expr(self, e: Expr) -> LayerExpr | None:
        if isinstance(e, Name):
            if e.id in self.defined:
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
        vals = {k: (_int if k == "window" else _bool)(self.r, v, k) for k, v in kw.items() if k != "act"}
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
                             vals.get("qkv_bias", bias), vals.get("out_bias", bias), vals.get("rope", True))


# ---- blocks ----------------------------------------------------------------------------------------------


def _model(r: _Report, block: ModelBlock) -> ModelConfig | None:
    s = _unique(r, [i for i in block.items if isinstance(i, Setting)], "model setting", MODEL_KEYS)
    for key, example in REQUIRED.items():
        if key not in s:
            r.error(block, f"model `{block.name}` is missing the required setting `{key}`",
                    f"add `{key} = {example}` to the model block")
    ints = {k: _int(r, s[k].value, k) for k in SIZE_KEYS if k in s}
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

    layer_blocks = [i for i in block.items if isinstance(i, LayerBlock)]
    if not layer_blocks:
        r.error(block, f"model `{block.name}` has no layer block",
                "add `layer { x = x + attention(norm(x))  x = x + mlp(norm(x), act = swiglu) }`")
    for extra in layer_blocks[1:]:
        r.error(extra, f"a second layer block (the first is on line {layer_blocks[0].span.line})",
                "a model has exactly one layer block: merge them")
    layer = _Layer(r)
    body = layer.body(layer_blocks[0]) if layer_blocks else ()
    if layer.uses_mlp and "ffn" not in s:
        r.error(block, f"model `{block.name}` is missing the setting `ffn`, which mlp() needs",
                "add `ffn = <hidden size of the MLP>` to the model block")
    if r.diags:
        return None
    return ModelConfig(
        name=block.name, vocab=ints["vocab"], dim=dim, layers=ints["layers"], heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn=ints.get("ffn", 0), context=ints["context"], norm=norm, body=body, rope=rope,
        positions=positions, tie_embeddings=flags.get("tie_embeddings", False),
        final_norm=flags.get("final_norm", True),
    )


_QUANT_COMMON = ("method", "calibration", "tokens", "lm_head", "embeddings")
QUANT_FUNCS = {"int8": _QUANT_COMMON, "int4": ("group", "symmetric", *_QUANT_COMMON)}
QUANT_GROUPS = (32, 64, 128)


def _quantize(r: _Report, e: Expr) -> dict | None:
    """`quantize = int8` or `int4(group = 128, method = gptq, ...)` -> the kwargs of kiln.quantization.QuantScheme."""
    found = _config_call(r, e, "quantize", QUANT_FUNCS, "int4(group = 128, method = gptq)")
    if found is None:
        return None
    func, kw = found
    out: dict = {"bits": 8 if func == "int8" else 4, "group": 0 if func == "int8" else 128}
    if "group" in kw:
        g = kw["group"]
        if isinstance(g, Num) and g.value in QUANT_GROUPS:
            out["group"] = g.value
        else:
            r.error(g, f"group must be one of {', '.join(map(str, QUANT_GROUPS))}, got {format_expr(g)}",
                    "weights share one scale per group of this many input features, e.g. group = 128")
            out = None
    if "method" in kw and out is not None:
        method = _enum(r, kw["method"], "method", "quantization method", ("rtn", "gptq"))
        out = out | {"method": method} if method else None
    if "calibration" in kw and out is not None:
        c = kw["calibration"]
        if isinstance(c, Str) and c.value:
            path = Path(c.value)
            if not path.is_absolute() and r.spec.path not in ("", "<spec>"):
                path = Path(r.spec.path).parent / path  # relative to the spec file, like any include
            out["calibration"] = str(path)
        else:
            r.error(c, f"calibration must be a file name in quotes, got {format_expr(c)}",
                    'e.g. calibration = "calib.txt" (a text file), or tokens = 512 for random tokens')
            out = None
    vals = {k: (_int if k == "tokens" else _bool)(r, kw[k], k) for k in ("tokens", "symmetric", "lm_head",
                                                                        "embeddings") if k in kw}
    if out is None or None in vals.values():
        return None
    return out | vals


def _compile(r: _Report, block: CompileBlock | None) -> CompileConfig:
    if block is None:
        return CompileConfig()
    s = _unique(r, block.settings, "compile setting", COMPILE_KEYS, PLANNED_COMPILE_KEYS)
    dtype = _enum(r, s["dtype"].value, "dtype", "dtype", DTYPES) if "dtype" in s else "fp32"
    extra = {}
    if "quantize" in s:
        extra["quantize"] = _quantize(r, s["quantize"].value)
    return CompileConfig(dtype=dtype or "fp32", extra=extra)


def resolve(spec: SpecFile) -> tuple[ModelConfig, CompileConfig]:
    """Validate `spec` and resolve it; raises one SpecError listing every problem found."""
    r = _Report(spec)
    model = _model(r, spec.model)
    compile_config = _compile(r, spec.compile)
    if r.diags or model is None:
        raise SpecError(r.diags)
    return model, compile_config
