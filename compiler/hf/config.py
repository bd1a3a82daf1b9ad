"""Hugging Face config.json -> ModelConfig, and the .kiln text `kiln import` prints for it (kiln.hf.to_spec).

Supported families: llama, mistral (and ministral), qwen2, qwen3, gpt2. config.json is read as transformers reads
it (kiln.hf.values: typed values, key precedence, the keys each family reads); the values are then checked by
the spec validator itself, on the spec kiln would write. Anything kiln cannot express raises a KilnError naming
the config key and the file; keys transformers ignores for the family are ignored too, and named in a note.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kiln.errors import KilnError, SpecError
from kiln.hf.to_spec import config_to_spec
from kiln.hf.values import Reader, check_keys, layer_window, refuse_spec_errors, rope_config
from kiln.model_config import (
    Add,
    AttentionCall,
    LayerAssign,
    MlpCall,
    ModelConfig,
    NormCall,
    NormConfig,
    Var,
)
from kiln.spec.formatter import format_spec
from kiln.spec.loader import parse_and_resolve

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gpt2")
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json has none (not hidden_size / heads)
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
    """The parsed config.json of a checkpoint directory (a JSON object, else a KilnError naming the file)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        if not Path(hf_dir).exists():
            raise KilnError(f"{hf_dir}: does not exist; point at a Hugging Face checkpoint directory")
        if Path(hf_dir).suffix == ".kiln":
            raise KilnError(f"{hf_dir}: is a spec file, not a checkpoint; point at a Hugging Face checkpoint "
                            "directory (a spec is already a spec: `kiln check` / `kiln fmt` read it)")
        if Path(hf_dir).is_file():  # e.g. model.safetensors or config.json itself: the folder holds the config
            raise KilnError(f"{hf_dir}: is a file; give the checkpoint directory that holds it (with config.json "
                            f"and the *.safetensors), e.g. {Path(hf_dir).resolve().parent}")
        raise KilnError(f"{hf_dir}: no config.json; point at a Hugging Face checkpoint directory")
    try:
        hf = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, OSError) as e:
        raise KilnError(f"{path}: not valid JSON or not readable ({e}); re-save the checkpoint's config") from None
    if not isinstance(hf, dict):
        raise KilnError(f"{path}: holds a JSON {type(hf).__name__}, not an object of config keys; "
                        "re-save the checkpoint's config with transformers")
    return hf


def _standard_body(window: int | None, qkv_bias: bool, out_bias: bool, act: str, mlp_bias: bool,
                   qk_norm: bool = False):
    x = Var("x")
    attn = AttentionCall(NormCall(x, "norm0"), "attn0", causal=True, window=window, qkv_bias=qkv_bias,
                         out_bias=out_bias, qk_norm="rms" if qk_norm else None)
    mlp = MlpCall(NormCall(x, "norm1"), "mlp0", act=act, bias=mlp_bias)
    return (LayerAssign("x", Add(x, attn)), LayerAssign("x", Add(x, mlp)))


def _act(r: Reader, key: str, default: str, table: dict[str, str], model_type: str) -> str:
    hf_act = r.str(key, default)
    if hf_act not in table:
        raise KilnError(f"{r.source}: config key `{key}`: {model_type} activation {hf_act!r} is not "
                        f"supported; supported: {', '.join(table)}")
    return table[hf_act]


def config_from_hf(
    hf: dict, name: str = "", *, source: str = "config.json", notes: list[str] | None = None
) -> ModelConfig:
    """The ModelConfig for a parsed config.json, read as transformers reads it, checked by the spec validator.

    name defaults to the model type; source names the file in messages; notes, when given, receives one line
    about keys kiln ignores because transformers ignores them for this family too.
    """
    if not isinstance(hf, dict):
        raise KilnError(f"{source}: holds a JSON {type(hf).__name__}, not an object of config keys")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KilnError(f"{source}: model_type {model_type!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    ignored = check_keys(hf, model_type, source)
    if ignored and notes is not None:
        notes.append(f"{source}: keys transformers' {model_type} model does not read, ignored by kiln too: "
                     f"{', '.join(ignored)}")
    r = Reader(hf, source)
    cfg = _gpt2(r) if model_type == "gpt2" else _llama_family(r, model_type)
    if notes is not None:
        notes.extend(r.notes)
    return _validated(cfg, r, name or model_type)


def _llama_family(r: Reader, model_type: str) -> ModelConfig:
    dim = r.int("dim", "hidden_size")
    heads = r.int("heads", "num_attention_heads")
    layers = r.int("layers", "num_hidden_layers")
    context = r.int("context", "max_position_embeddings")
    kv_heads = r.int("kv_heads", "num_key_value_heads", default=None)
    if kv_heads is None:
        kv_heads = heads
        r.derive("kv_heads", "heads")
    qwen3 = model_type == "qwen3"
    head_dim = r.int("head_dim", "head_dim", default=None)
    if head_dim is None and qwen3:  # Qwen3Config has a head_dim of its own
        head_dim = QWEN3_HEAD_DIM
        r.origins.setdefault("head_dim", []).append(f"head_dim (absent: the class default {QWEN3_HEAD_DIM})")
    elif head_dim is None:  # transformers: hidden_size // num_attention_heads
        head_dim = dim // heads if heads > 0 else 0
        r.derive("head_dim", "dim", "heads")
    # Llama's and Qwen3's attention_bias switches biases on q, k, v and o; Mistral's and Qwen2's attention ignore
    # it (Qwen2 always has q/k/v biases), as transformers does. Only Llama has mlp_bias.
    attention_bias = model_type in ("llama", "qwen3") and r.bool("attention_bias", False)
    mlp_bias = model_type == "llama" and r.bool("mlp_bias", False)
    return ModelConfig(
        name="hf",
        vocab=r.int("vocab", "vocab_size"),
        dim=dim,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=r.int("ffn", "intermediate_size"),
        context=context,
        norm=NormConfig("rms", r.float("eps", "rms_norm_eps", default=1e-6)),
        body=_standard_body(
            layer_window(r, model_type, layers),
            model_type == "qwen2" or attention_bias,
            attention_bias,
            _act(r, "hidden_act", "silu", _GATED, model_type),
            mlp_bias,
            qk_norm=qwen3,  # Qwen3: RMSNorm over each head of q and k, with rms_norm_eps
        ),
        rope=rope_config(r, context),
        positions="rope",
        tie_embeddings=r.bool("tie_word_embeddings", False),
    )


def _gpt2(r: Reader) -> ModelConfig:
    if r.bool("scale_attn_by_inverse_layer_idx", False):
        raise KilnError(f"{r.source}: gpt2 scale_attn_by_inverse_layer_idx is not supported; kiln scales by "
                        "1/sqrt(head_dim)")
    if not r.bool("scale_attn_weights", True):
        raise KilnError(f"{r.source}: gpt2 scale_attn_weights = false is not supported; kiln scales by "
                        "1/sqrt(head_dim)")
    if r.bool("add_cross_attention", False):
        raise KilnError(f"{r.source}: gpt2 add_cross_attention is not supported; kiln builds decoder-only models")
    dim = r.int("dim", "n_embd", "hidden_size")
    heads = r.int("heads", "n_head", "num_attention_heads")
    r.derive("kv_heads", "heads")
    r.derive("head_dim", "dim", "heads")
    ffn = r.int("ffn", "n_inner", default=None)
    if ffn is None:
        ffn = 4 * dim
        r.derive("ffn", "dim")
    return ModelConfig(
        name="hf",
        vocab=r.int("vocab", "vocab_size"),
        dim=dim,
        layers=r.int("layers", "n_layer", "num_hidden_layers"),
        heads=heads,
        kv_heads=heads,
        head_dim=dim // heads if heads > 0 else 0,
        ffn=ffn,
        context=r.int("context", "n_positions", "max_position_embeddings"),
        norm=NormConfig("layer", r.float("eps", "layer_norm_epsilon", default=1e-5)),
        body=_standard_body(None, True, True, _act(r, "activation_function", "gelu_new", _PLAIN, "gpt2"), True),
        rope=None,
        positions="learned",
        tie_embeddings=r.bool("tie_word_embeddings", True),
    )


def _validated(cfg: ModelConfig, r: Reader, name: str) -> ModelConfig:
    """cfg as the spec validator resolves it: the spec `kiln import` would write must pass `kiln check`."""
    try:
        resolved = parse_and_resolve(format_spec(config_to_spec(cfg)), r.source).model
    except SpecError as e:
        raise refuse_spec_errors(e, r) from None
    return dataclasses.replace(resolved, name=name)


def import_spec(hf_dir: str | Path, name: str = "", notes: list[str] | None = None) -> tuple[ModelConfig, str]:
    """(config, spec text) that `kiln import` writes for a checkpoint; the text is resolved before it is returned,
    so a spec kiln import writes always passes `kiln check`."""

    src = Path(hf_dir)
    cfg = config_from_hf(load_hf_config(src), name=name or src.resolve().name, source=str(src / "config.json"),
                         notes=notes)
    text = f"# imported by `kiln import` from {src}\n" + format_spec(config_to_spec(cfg))
    try:
        parse_and_resolve(text, "<kiln import>")
    except SpecError as e:
        raise KilnError(f"the spec for {src} does not resolve ({e}); pass a plain --name such as --name my_model") \
            from None
    return cfg, text
