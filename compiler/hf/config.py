"""Hugging Face config.json -> ModelConfig, and ModelConfig -> spec AST (what `kiln import` prints).

Supported families: llama, mistral, qwen2, gpt2. Both the transformers v4 spelling of rotary settings
(`rope_theta` + `rope_scaling`) and the v5 one (`rope_parameters` holding `rope_theta` and the scaling
keys) are read. Anything kiln cannot express raises KilnError naming the feature and what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.model_config import (
    Add,
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2")
# HF activation names -> kiln activation of the gated MLP (llama family) or the plain MLP (gpt2).
_GATED = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_new": "geglu_tanh",
    "gelu_pytorch_tanh": "geglu_tanh",
}
_PLAIN = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def load_hf_config(hf_dir: str | Path) -> dict:
    """The parsed config.json of a checkpoint directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise KilnError(f"{hf_dir}: no config.json; point at a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KilnError(f"{path}: not valid JSON ({e})") from None


def _require(hf: dict, *keys: str) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise KilnError(f"config.json has no {' / '.join(keys)}; the checkpoint's config is incomplete")


def _rope(hf: dict, context: int) -> RopeConfig:
    # v5 keeps everything in rope_parameters; v4 has rope_theta at top level and scaling in rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    if params and not any(k in params for k in ("rope_theta", "rope_type", "type", "factor")):
        raise KilnError("per-layer-type rope_parameters are not supported; kiln uses one rotary setting")
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise KilnError("partial_rotary_factor != 1 is not supported; kiln rotates the whole head")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling=RopeScaling("linear", factor=float(params["factor"])))
    if kind == "llama3":
        scale = RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_context=int(params.get("original_max_position_embeddings", context)),
        )
        return RopeConfig(theta=theta, scaling=scale)
    raise KilnError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def _window(hf: dict, model_type: str, layers: int) -> int | None:
    """The sliding window shared by every layer, or None; kiln's layer body is the same for all layers."""
    if model_type == "mistral":
        return hf.get("sliding_window")
    if model_type != "qwen2" or not hf.get("use_sliding_window"):
        return None
    types = hf.get("layer_types")
    if types is None:  # the v4 rule: layers at index >= max_window_layers slide
        first = int(hf.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if set(types) == {"full_attention"}:
        return None
    if set(types) == {"sliding_attention"}:
        return int(_require(hf, "sliding_window"))
    raise KilnError(
        f"qwen2 with sliding window on some layers only (layer_types {types}) is not supported; "
        "kiln applies one attention setting to every layer (max_window_layers 0 or >= num_hidden_layers)"
    )


def _standard_body(window: int | None, qkv_bias: bool, out_bias: bool, act: str, mlp_bias: bool):
    x = Var("x")
    attn = AttentionCall(
        NormCall(x, "norm0"), "attn0", causal=True, window=window, qkv_bias=qkv_bias, out_bias=out_bias
    )
    mlp = MlpCall(NormCall(x, "norm1"), "mlp0", act=act, bias=mlp_bias)
    return (LayerAssign("x", Add(x, attn)), LayerAssign("x", Add(x, mlp)))


def _act(hf_act: str, table: dict[str, str], model_type: str) -> str:
    if hf_act not in table:
        raise KilnError(f"{model_type} activation {hf_act!r} is not supported; supported: {', '.join(table)}")
    return table[hf_act]


def config_from_hf(hf: dict, name: str = "") -> ModelConfig:
    """The ModelConfig for a parsed config.json; `name` defaults to the model type."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KilnError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    name = name or model_type
    if model_type == "gpt2":
        return _gpt2(hf, name)

    dim = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    layers = int(_require(hf, "num_hidden_layers"))
    context = int(_require(hf, "max_position_embeddings"))
    qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
    out_bias = model_type == "llama" and bool(hf.get("attention_bias", False))
    mlp_bias = model_type == "llama" and bool(hf.get("mlp_bias", False))
    act = _act(hf.get("hidden_act", "silu"), _GATED, model_type)
    return ModelConfig(
        name=name,
        vocab=int(_require(hf, "vocab_size")),
        dim=dim,
        layers=layers,
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or dim // heads),
        ffn=int(_require(hf, "intermediate_size")),
        context=context,
        norm=NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6))),
        body=_standard_body(_window(hf, model_type, layers), qkv_bias, out_bias, act, mlp_bias),
        rope=_rope(hf, context),
        positions="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _gpt2(hf: dict, name: str) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise KilnError("gpt2 scale_attn_by_inverse_layer_idx is not supported; kiln scales by 1/sqrt(head_dim)")
    if hf.get("scale_attn_weights", True) is False:
        raise KilnError("gpt2 scale_attn_weights = false is not supported; kiln scales by 1/sqrt(head_dim)")
    if hf.get("add_cross_attention"):
        raise KilnError("gpt2 add_cross_attention is not supported; kiln builds decoder-only models")
    dim = int(_require(hf, "n_embd", "hidden_size"))
    heads = int(_require(hf, "n_head", "num_attention_heads"))
    act = _act(hf.get("activation_function", "gelu_new"), _PLAIN, "gpt2")
    return ModelConfig(
        name=name,
        vocab=int(_require(hf, "vocab_size")),
        dim=dim,
        layers=int(_require(hf, "n_layer", "num_hidden_layers")),
        heads=heads,
        kv_heads=heads,
        head_dim=dim // heads,
        ffn=int(hf.get("n_inner") or 4 * dim),
        context=int(_require(hf, "n_positions", "max_position_embeddings")),
        norm=NormConfig("layer", float(hf.get("layer_norm_epsilon", 1e-5))),
        body=_standard_body(None, True, True, act, True),
        rope=None,
        positions="learned",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


# ---- ModelConfig -> spec AST -------------------------------------------------------------------------------


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
