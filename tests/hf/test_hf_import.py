"""config.json -> ModelConfig for each supported family, and ModelConfig -> spec round trips."""

from __future__ import annotations

import json

import pytest

from kiln.errors import KilnError
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.to_spec import config_to_spec
from kiln.model_config import AttentionCall, CompileConfig, MlpCall, NormCall, RopeScaling, param_shapes
from tests.support.hf_models import MISTRAL_WINDOW, _config


def saved(family: str, tmp_path, **overrides) -> dict:
    _config(family, **overrides).save_pretrained(tmp_path)
    return load_hf_config(tmp_path)


def sites(cfg):
    return {s.site: s for s in cfg.sites()}


def test_llama_fields(tmp_path):
    cfg = config_from_hf(saved("llama", tmp_path), name="tiny")
    assert (cfg.name, cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.context) == (
        "tiny",
        288,
        32,
        2,
        4,
        2,
        8,
        64,
        64,
    )
    assert cfg.norm.kind == "rms" and cfg.norm.eps == 1e-6
    assert cfg.rope.theta == 10000.0
    assert cfg.rope.scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert not cfg.tie_embeddings and cfg.positions == "rope"
    s = sites(cfg)
    assert list(s) == ["norm0", "attn0", "norm1", "mlp0"]
    assert isinstance(s["norm0"], NormCall) and isinstance(s["attn0"], AttentionCall)
    assert s["attn0"].window is None and not s["attn0"].qkv_bias and not s["attn0"].out_bias
    assert isinstance(s["mlp0"], MlpCall) and s["mlp0"].act == "swiglu" and not s["mlp0"].bias


BIASED_LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "mlp_bias": True,
    "rope_theta": 500000.0,
    "rope_scaling": {"type": "linear", "factor": 2.0},
    "tie_word_embeddings": True,
}


def test_llama_bias_flags_and_v4_rope_spelling():
    cfg = config_from_hf(BIASED_LLAMA)
    s = sites(cfg)
    assert cfg.name == "llama" and cfg.kv_heads == 4 and cfg.head_dim == 16 and cfg.tie_embeddings
    assert s["attn0"].qkv_bias and s["attn0"].out_bias and s["mlp0"].bias
    assert cfg.rope.theta == 500000.0 and cfg.rope.scaling == RopeScaling("linear", 2.0)
    assert "layers.0.mlp0.gate.bias" in param_shapes(cfg) and "lm_head.weight" not in param_shapes(cfg)


def test_v4_and_v5_rope_spellings_agree(tmp_path):
    v5 = saved("llama", tmp_path)
    params = dict(v5.pop("rope_parameters"))
    v4 = {**v5, "rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    assert config_from_hf(v4) == config_from_hf(load_hf_config(tmp_path))


def test_mistral_window(tmp_path):
    cfg = config_from_hf(saved("mistral", tmp_path))
    assert sites(cfg)["attn0"].window == MISTRAL_WINDOW
    assert config_from_hf({**load_hf_config(tmp_path), "sliding_window": None}).sites()[1].window is None


def test_qwen2_bias_tied_and_windows(tmp_path):
    hf = saved("qwen2", tmp_path)
    cfg = config_from_hf(hf)
    a = sites(cfg)["attn0"]
    assert a.qkv_bias and not a.out_bias and a.window is None and cfg.tie_embeddings
    every = {**hf, "use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"] * 2}
    assert sites(config_from_hf(every))["attn0"].window == 8
    v4 = {k: v for k, v in every.items() if k != "layer_types"}
    assert sites(config_from_hf({**v4, "max_window_layers": 0}))["attn0"].window == 8
    assert sites(config_from_hf({**v4, "max_window_layers": 2}))["attn0"].window is None
    with pytest.raises(KilnError, match="some layers only"):
        config_from_hf({**v4, "max_window_layers": 1})


def test_gpt2_fields(tmp_path):
    cfg = config_from_hf(saved("gpt2", tmp_path))
    assert (cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.context) == (32, 4, 4, 8, 128, 64)
    assert cfg.norm.kind == "layer" and cfg.norm.eps == 1e-5
    assert cfg.rope is None and cfg.positions == "learned" and cfg.tie_embeddings
    s = sites(cfg)
    assert s["attn0"].qkv_bias and s["attn0"].out_bias and s["mlp0"].bias and s["mlp0"].act == "gelu_tanh"


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"model_type": "falcon"},
         "'falcon' is not supported; supported: llama, mistral, ministral, qwen2, qwen3, gpt2"),
        (
            {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx",
        ),
        ({"model_type": "llama", "hidden_act": "tanh"}, "activation 'tanh' is not supported"),
    ],
)
def test_unsupported(hf, match):
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "max_position_embeddings": 8,
    }
    with pytest.raises(KilnError, match=match):
        config_from_hf({**base, **hf})


def test_unsupported_rope():
    hf = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "max_position_embeddings": 8,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
    }
    with pytest.raises(KilnError, match="rope scaling 'yarn' is not supported; supported: default, linear, llama3"):
        config_from_hf(hf)


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(KilnError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(KilnError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert load_hf_config(tmp_path) == {"model_type": "qwen2"}


def test_config_to_spec_shape(tmp_path):
    spec = config_to_spec(config_from_hf(saved("llama", tmp_path)), CompileConfig(dtype="bf16"))
    keys = [getattr(item, "key", "layer") for item in spec.model.items]
    assert keys == [
        "vocab",
        "dim",
        "layers",
        "heads",
        "kv_heads",
        "head_dim",
        "ffn",
        "context",
        "norm",
        "rope",
        "layer",
    ]
    assert spec.compile.settings[0].key == "dtype" and spec.compile.settings[0].value.id == "bf16"
    layer = spec.model.items[-1]
    assert [a.value.right.func for a in layer.body] == ["attention", "mlp"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2", "biased-llama"])
def test_spec_round_trip(family, tmp_path):
    parser = pytest.importorskip("kiln.spec.parser")
    formatter = pytest.importorskip("kiln.spec.formatter")
    validate = pytest.importorskip("kiln.spec.validate")
    hf = BIASED_LLAMA if family == "biased-llama" else saved(family, tmp_path)
    cfg = config_from_hf(hf, name=f"tiny-{family}")
    text = formatter.format_spec(config_to_spec(cfg, CompileConfig(dtype="bf16")))
    model, comp = validate.resolve(parser.parse_spec(text, "<import>"))
    assert model == cfg, text
    assert comp.dtype == "bf16"


LLAMA_MIN = {
    "model_type": "llama",
    "vocab_size": 10,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 16,
    "max_position_embeddings": 8,
}


@pytest.mark.parametrize(
    "rope, want",
    [
        # transformers: a legacy rope_scaling replaces rope_parameters (not merged); its theta comes from the
        # top level when it has none
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
          "rope_scaling": {"type": "linear", "factor": 2.0}}, (1e4, "linear", 2.0)),
        ({"rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, (500.0, "linear", 2.0)),
        ({"rope_theta": 500.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}, (7.0, None, None)),
        ({"rope_theta": 500.0, "rope_parameters": {"rope_type": "linear", "factor": 3.0}}, (500.0, "linear", 3.0)),
        ({"rope_scaling": {"rope_type": "linear", "type": "llama3", "factor": 2.0}}, (1e4, "linear", 2.0)),
    ],
)
def test_rope_precedence_follows_transformers(rope, want, tmp_path):
    import transformers as tf

    cfg = config_from_hf({**LLAMA_MIN, **rope})
    scaling = cfg.rope.scaling
    assert (cfg.rope.theta, scaling and scaling.kind, scaling and scaling.factor) == want
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_MIN, **rope}))
    params = tf.AutoConfig.from_pretrained(tmp_path).rope_parameters  # the oracle agrees
    assert params["rope_theta"] == want[0] and params["rope_type"] == (want[1] or "default")


def test_llama3_original_context_prefers_the_top_level_key():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    assert config_from_hf({**LLAMA_MIN, "rope_parameters": rope}).rope.scaling.original_context == 16
    top = {**LLAMA_MIN, "rope_parameters": rope, "original_max_position_embeddings": 4}
    assert config_from_hf(top).rope.scaling.original_context == 4
    del rope["original_max_position_embeddings"]
    assert config_from_hf({**LLAMA_MIN, "rope_parameters": rope}).rope.scaling.original_context == 8


def test_unread_keys_are_noted_and_values_are_named_with_the_file():
    notes: list[str] = []
    config_from_hf({**LLAMA_MIN, "frobnicate": 1, "sliding_window": 4}, notes=notes, source="ck/config.json")
    assert len(notes) == 1 and "frobnicate" in notes[0] and "sliding_window" in notes[0]
    with pytest.raises(KilnError, match=r"ck/config.json: .*`num_hidden_layers`: layers must be a positive"):
        config_from_hf({**LLAMA_MIN, "num_hidden_layers": -1}, source="ck/config.json")
    with pytest.raises(KilnError, match="`intermediate_size` must be a whole number"):
        config_from_hf({**LLAMA_MIN, "intermediate_size": 16.0})


def test_rope_keys_the_type_does_not_use_are_noted():
    notes: list[str] = []
    rope = {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}
    assert config_from_hf({**LLAMA_MIN, "rope_parameters": rope}, notes=notes).rope.scaling.factor == 2.0
    assert len(notes) == 1 and "beta_fast" in notes[0] and "rope_parameters" in notes[0]


def test_odd_head_dim_with_rope_is_refused_naming_the_key():
    # rotate-half needs an even head_dim; kiln import wrote a spec whose run crashed
    with pytest.raises(KilnError, match=r"config key `head_dim`: rope needs an even head_dim, but head_dim is 3"):
        config_from_hf({**LLAMA_MIN, "head_dim": 3})
    with pytest.raises(KilnError, match=r"`hidden_size`, `num_attention_heads`: rope needs an even head_dim"):
        config_from_hf({**LLAMA_MIN, "hidden_size": 6})
