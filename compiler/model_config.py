"""The resolved, validated model description that the frontend builds graphs from.

Validation (kiln.spec.validate) turns a SpecFile AST into a ModelConfig plus a CompileConfig; the HF importer
builds the same ModelConfig from a config.json. Everything downstream (frontend, weights, runtime) reads
only these dataclasses, never the AST.

Parameter names are a contract shared by the frontend, random init and the HF loader; `param_shapes`
is the single place that defines them:

    embed.weight                       [vocab, dim]
    pos_embed.weight                   [context, dim]               (positions = learned)
    layers.{i}.{norm}.weight / .bias   [dim]                        (bias for layer norm only)
    layers.{i}.{attn}.q.weight         [heads * head_dim, dim]      (.bias [heads * head_dim] if qkv_bias)
    layers.{i}.{attn}.k.weight         [kv_heads * head_dim, dim]   (.bias if qkv_bias)
    layers.{i}.{attn}.v.weight         [kv_heads * head_dim, dim]   (.bias if qkv_bias)
    layers.{i}.{attn}.o.weight         [dim, heads * head_dim]      (.bias [dim] if out_bias)
    layers.{i}.{attn}.q_norm.weight    [head_dim]                   (qk_norm: shared by every q head)
    layers.{i}.{attn}.k_norm.weight    [head_dim]                   (qk_norm: shared by every k head)
    layers.{i}.{mlp}.gate.weight       [ffn, dim]                   (gated activations only; .bias if bias)
    layers.{i}.{mlp}.up.weight         [ffn, dim]                   (.bias [ffn] if bias)
    layers.{i}.{mlp}.down.weight       [dim, ffn]                   (.bias [dim] if bias)
    final_norm.weight / .bias          [dim]                        (final_norm = true)
    lm_head.weight                     [vocab, dim]                 (absent when tie_embeddings)

Site names ({norm}, {attn}, {mlp}) are assigned in source order within the layer body: norm0, norm1, ...,
attn0, ..., mlp0, ... Each call of norm()/attention()/mlp() in the body is its own site with its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

KV_BLOCK_MAX = 256  # tokens per KV cache block at most (a power of two; the runtime, the spec and the kernels agree)

GATED_ACTS = ("swiglu", "geglu", "geglu_tanh")
PLAIN_ACTS = ("gelu", "gelu_tanh", "silu", "relu")
DTYPES = ("fp32", "fp16", "bf16")  # the float dtypes a model computes in (the names specs and flags use)
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# vLLM's (and torch's) names for them, which --dtype and LLM(dtype=...) take too; "auto" (vLLM's default) is the
# spec's dtype, or a checkpoint's own (config.json's torch_dtype) when there is no spec (kiln.build)
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
DTYPE_AUTO = "auto"
DTYPE_NAMES = (DTYPE_AUTO, *DTYPES, *DTYPE_ALIASES)  # every name --dtype accepts


def dtype_name(name: object) -> str | None:
    """kiln's name (one of DTYPES) for a dtype given as kiln's, vLLM's or torch's name (also a torch.dtype, as
    vLLM's LLM(dtype=torch.bfloat16)); "auto" and None stay as they are; anything else is returned unchanged, for
    the caller to refuse with its own context."""
    if name is None:
        return None
    text = str(name).removeprefix("torch.")
    if text in DTYPES or text == DTYPE_AUTO:
        return text
    return DTYPE_ALIASES.get(text, name if isinstance(name, str) else text)
KV_DTYPES = ("auto", "int8")  # the KV cache: auto = the model's dtype; int8 with per-token-and-head scales
INT4_GROUPS = (32, 64, 128)  # int4 quantization group sizes the kernels support


@dataclass(frozen=True)
class NormConfig:
    kind: Literal["rms", "layer"]
    eps: float


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. kind "llama3" uses all fields; kind "linear" uses `factor` only."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling: RopeScaling | None = None


# ---- the layer program: the layer body after name resolution -------------------------------------------


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Add:
    left: LayerExpr
    right: LayerExpr


@dataclass(frozen=True)
class NormCall:
    arg: LayerExpr
    site: str


@dataclass(frozen=True)
class AttentionCall:
    arg: LayerExpr
    site: str
    causal: bool = True
    window: int | None = None  # attend to the last `window` positions, the current one included
    qkv_bias: bool = False
    out_bias: bool = False
    rope: bool = True  # rotary embedding on q and k (only meaningful when the model has rope)
    # "rms": an RMSNorm over each head of q and of k (weights [head_dim], the model norm's eps), after the
    # projections and before rope (Qwen3); None: no q/k norm
    qk_norm: Literal["rms"] | None = None


@dataclass(frozen=True)
class MlpCall:
    arg: LayerExpr
    site: str
    act: str  # one of GATED_ACTS or PLAIN_ACTS
    bias: bool = False

    @property
    def gated(self) -> bool:
        return self.act in GATED_ACTS


LayerExpr = Var | Add | NormCall | AttentionCall | MlpCall


@dataclass(frozen=True)
class LayerAssign:
    target: str
    value: LayerExpr


# ---- configs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModConfig:
    """Mixture-of-Depths routing (Raposo et al., 2024): `route = mod(capacity = 0.125, every = 2, decide = threshold)`.

    Layer i is routed when (i + 1) % every == 0 (every = 2: layers 1, 3, 5, ...). A router scores each token on the
    layer's input x: r = x @ router.weight.T + router.bias. Routed tokens go through the whole layer body and leave
    it as x + r * (body(x) - x); the others pass by unchanged. Training form: the top ceil(capacity * T) tokens of
    each sequence by r. Causal form (what kiln serves): r > router.threshold (decide = threshold), or a predictor
    MLP's logit > 0 (decide = predictor). Attention in a routed layer runs among that layer's routed tokens only
    (rotary positions stay the original ones), and a token that skips the layer writes no K/V there.
    Weights per routed layer i (next to the layer's own):
        layers.{i}.router.weight [1, dim], layers.{i}.router.bias [1], layers.{i}.router.threshold [1]
        layers.{i}.router.predictor.fc1.weight [hidden, dim] / .bias [hidden]   (decide = predictor)
        layers.{i}.router.predictor.fc2.weight [1, hidden] / .bias [1]          (silu between fc1 and fc2)
    """

    capacity: float  # in (0, 1]: the fraction of tokens a routed layer processes (training form)
    every: int = 2
    decide: Literal["threshold", "predictor"] = "threshold"
    hidden: int = 0  # the predictor's hidden width (decide = predictor only)

    def routed(self, layer: int) -> bool:
        return (layer + 1) % self.every == 0


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding (compile key `speculation`, flag --speculation, LLM(speculation=...)).

    ngram(n = 3, k = 4): prompt lookup, the k tokens that followed the latest earlier match of the last n (down to
    1) tokens; self(layers = L, k = 4): the target's first L layers, final norm and head, sharing the target's KV
    cache for those layers; draft(spec = "...", weights = "...", k = 4): a second model with the same tokenizer and
    its own KV pool over the same block tables.
    """

    kind: Literal["ngram", "self", "draft"]
    k: int = 4  # tokens proposed per step
    n: int = 3  # ngram only
    layers: int = 0  # self only
    spec: str = ""  # draft only: a spec file or bundled spec name
    weights: str = ""  # draft only: its weights (a checkpoint directory, .safetensors or .gguf)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int  # the longest sequence the model takes (prompt + generated)
    norm: NormConfig
    body: tuple[LayerAssign, ...]  # the layer program; the last assignment is to `x`
    rope: RopeConfig | None = None
    positions: Literal["rope", "learned", "none"] = "rope"
    tie_embeddings: bool = False
    final_norm: bool = True
    route: ModConfig | None = None  # Mixture-of-Depths routing; None: every layer is dense

    def sites(self) -> list[NormCall | AttentionCall | MlpCall]:
        """Every norm/attention/mlp call in the layer body, in site-name order."""
        found: list[NormCall | AttentionCall | MlpCall] = []

        def walk(e: LayerExpr) -> None:
            if isinstance(e, Add):
                walk(e.left)
                walk(e.right)
            elif isinstance(e, (NormCall, AttentionCall, MlpCall)):
                walk(e.arg)
                found.append(e)

        for stmt in self.body:
            walk(stmt.value)
        return found


@dataclass(frozen=True)
class CompileConfig:
    """The compile part of a spec after validation; CLI flags override it with dataclasses.replace."""

    dtype: str = "fp32"  # one of DTYPES
    extra: dict = field(default_factory=dict, compare=False)  # reserved for later passes' options


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight the model has, in a stable order (see the module docstring)."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab, cfg.dim)}
    if cfg.positions == "learned":
        shapes["pos_embed.weight"] = (cfg.context, cfg.dim)
    q_out, kv_out = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        for site in cfg.sites():
            p = f"layers.{i}.{site.site}"
            if isinstance(site, NormCall):
                shapes[f"{p}.weight"] = (cfg.dim,)
                if cfg.norm.kind == "layer":
                    shapes[f"{p}.bias"] = (cfg.dim,)
            elif isinstance(site, AttentionCall):
                for proj, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                    shapes[f"{p}.{proj}.weight"] = (out, cfg.dim)
                    if site.qkv_bias:
                        shapes[f"{p}.{proj}.bias"] = (out,)
                shapes[f"{p}.o.weight"] = (cfg.dim, q_out)
                if site.out_bias:
                    shapes[f"{p}.o.bias"] = (cfg.dim,)
                if site.qk_norm:
                    shapes[f"{p}.q_norm.weight"] = (cfg.head_dim,)
                    shapes[f"{p}.k_norm.weight"] = (cfg.head_dim,)
            else:
                projs = [("gate", cfg.ffn, cfg.dim)] if site.gated else []
                projs += [("up", cfg.ffn, cfg.dim), ("down", cfg.dim, cfg.ffn)]
                for proj, out, inp in projs:
                    shapes[f"{p}.{proj}.weight"] = (out, inp)
                    if site.bias:
                        shapes[f"{p}.{proj}.bias"] = (out,)
        if cfg.route is not None and cfg.route.routed(i):  # Mixture-of-Depths: see ModConfig
            p = f"layers.{i}.router"
            shapes |= {f"{p}.weight": (1, cfg.dim), f"{p}.bias": (1,), f"{p}.threshold": (1,)}
            if cfg.route.decide == "predictor":
                h = cfg.route.hidden
                shapes |= {f"{p}.predictor.fc1.weight": (h, cfg.dim), f"{p}.predictor.fc1.bias": (h,),
                           f"{p}.predictor.fc2.weight": (1, h), f"{p}.predictor.fc2.bias": (1,)}
    if cfg.final_norm:
        shapes["final_norm.weight"] = (cfg.dim,)
        if cfg.norm.kind == "layer":
            shapes["final_norm.bias"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab, cfg.dim)
    return shapes
