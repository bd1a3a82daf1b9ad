"""ModelConfig -> spec AST: the .kiln file `kiln import` prints (and a `kiln quantize` output's spec.kiln)."""

from __future__ import annotations

from kiln.model_config import (
    Add,
    AttentionCall,
    CompileConfig,
    LayerExpr,
    MlpCall,
    ModelConfig,
    NormCall,
    RopeConfig,
    Var,
)
from kiln.spec.ast import (
    Assign,
    BinOp,
    Bool,
    Call,
    CompileBlock,
    Expr,
    Keyword,
    LayerBlock,
    ModelBlock,
    Name,
    Num,
    Setting,
    SpecFile,
)


def _num(v: float | int) -> Num:
    # Integral floats print as ints (theta = 500000), which resolve back to equal values.
    return Num(int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 else v)


def _kw(**kwargs: Expr) -> tuple[Keyword, ...]:
    return tuple(Keyword(k, v) for k, v in kwargs.items())


def _expr(e: LayerExpr) -> Expr:
    if isinstance(e, Var):
        return Name(e.name)
    if isinstance(e, Add):
        return BinOp("+", _expr(e.left), _expr(e.right))
    if isinstance(e, NormCall):
        return Call("norm", (_expr(e.arg),))
    if isinstance(e, AttentionCall):
        kw: dict[str, Expr] = {"causal": Bool(e.causal)}
        if e.window is not None:
            kw["window"] = Num(e.window)
        if e.qkv_bias:
            kw["qkv_bias"] = Bool(True)
        if e.out_bias:
            kw["out_bias"] = Bool(True)
        if not e.rope:
            kw["rope"] = Bool(False)
        if e.qk_norm:
            kw["qk_norm"] = Name(e.qk_norm)
        return Call("attention", (_expr(e.arg),), _kw(**kw))
    if isinstance(e, MlpCall):
        kw = {"act": Name(e.act)}
        if e.bias:
            kw["bias"] = Bool(True)
        return Call("mlp", (_expr(e.arg),), _kw(**kw))
    raise TypeError(f"unknown layer expression {e!r}")


def _rope_expr(rope: RopeConfig) -> Call:
    kw: dict[str, Expr] = {"theta": _num(rope.theta)}
    s = rope.scaling
    if s is not None and s.kind == "llama3":
        kw["scaling"] = Call(
            "llama3",
            kwargs=_kw(
                factor=_num(s.factor),
                low=_num(s.low_freq_factor),
                high=_num(s.high_freq_factor),
                original=Num(s.original_context),
            ),
        )
    elif s is not None:
        kw["scaling"] = Call("linear", kwargs=_kw(factor=_num(s.factor)))
    return Call("rope", kwargs=_kw(**kw))


def config_to_spec(cfg: ModelConfig, compile: CompileConfig | None = None) -> SpecFile:
    """The spec AST describing `cfg` (and `compile`, when given); format_spec prints it as a .kiln file."""
    items: list[Setting | LayerBlock] = [
        Setting(key, Num(getattr(cfg, key)))
        for key in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "ffn", "context")
    ]
    items.append(Setting("norm", Call(cfg.norm.kind, kwargs=_kw(eps=Num(cfg.norm.eps)))))
    if cfg.rope is not None:
        items.append(Setting("rope", _rope_expr(cfg.rope)))
    if cfg.positions != "rope":
        items.append(Setting("positions", Name(cfg.positions)))
    if cfg.tie_embeddings:
        items.append(Setting("tie_embeddings", Bool(True)))
    if not cfg.final_norm:
        items.append(Setting("final_norm", Bool(False)))
    items.append(LayerBlock(tuple(Assign(s.target, _expr(s.value)) for s in cfg.body)))
    block = None
    if compile is not None:
        block = CompileBlock((Setting("dtype", Name(compile.dtype)),))
    return SpecFile(model=ModelBlock(cfg.name, tuple(items)), compile=block)
