"""config.json variants where kiln once disagreed with transformers without an error (issue 16).

Each checkpoint is loaded back by transformers with from_pretrained (so its own config precedence applies) and
compared with kiln's import of the same directory: equal logits, or a KilnError naming the config key.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln.cli import main
from kiln.errors import KilnError
from kiln.hf.config import config_from_hf, load_hf_config
from tests.support.hf_models import (
    MISTRAL_WINDOW,
    assert_same_logits,
    edit_config,
    save_hf_model,
)


def test_mistral_with_mixed_layer_types_is_refused_by_name(tmp_path, capsys):
    import transformers as tf

    save_hf_model("mistral", tmp_path, layer_types=["full_attention", "sliding_attention"])
    assert tf.AutoConfig.from_pretrained(tmp_path).model_type == "ministral"  # what transformers makes of it
    with pytest.raises(KilnError, match="layer_types"):
        config_from_hf(load_hf_config(tmp_path))
    out = tmp_path / "out.kiln"
    assert main(["import", str(tmp_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "layer_types" in err and "some layers only" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_mistral_with_uniform_layer_types_matches_ministral(tmp_path, kind):
    save_hf_model("mistral", tmp_path, layer_types=[kind, kind])
    window = config_from_hf(load_hf_config(tmp_path)).sites()[1].window
    assert window == (MISTRAL_WINDOW if kind == "sliding_attention" else None)
    assert_same_logits(tmp_path)


def test_qwen2_and_mistral_read_layer_types_alike(tmp_path):
    mixed = ["sliding_attention", "full_attention"]
    save_hf_model("qwen2", tmp_path, use_sliding_window=True, sliding_window=MISTRAL_WINDOW, layer_types=mixed)
    with pytest.raises(KilnError, match="layer_types"):
        config_from_hf(load_hf_config(tmp_path))


def test_legacy_rope_scaling_wins_over_rope_parameters(tmp_path):
    save_hf_model("llama", tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    rope = config_from_hf(load_hf_config(tmp_path)).rope
    assert rope.scaling is not None and (rope.scaling.kind, rope.scaling.factor) == ("linear", 2.0)
    assert_same_logits(tmp_path)


def test_mistral_attention_bias_is_ignored_as_transformers_does(tmp_path):
    save_hf_model("mistral", tmp_path)
    edit_config(tmp_path, attention_bias=True)
    attn = config_from_hf(load_hf_config(tmp_path)).sites()[1]
    assert not attn.qkv_bias and not attn.out_bias
    assert_same_logits(tmp_path)


def test_ignored_keys_are_named_on_stderr(tmp_path, capsys):
    save_hf_model("mistral", tmp_path)
    edit_config(tmp_path, attention_bias=True, my_custom_key=3)
    assert main(["import", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "attention_bias" in err and "my_custom_key" in err


def test_ministral_checkpoint_matches(tmp_path):
    import transformers as tf

    from tests.support.hf_models import SMALL

    cfg = tf.MinistralConfig(**{**SMALL, "sliding_window": MISTRAL_WINDOW, "head_dim": 8})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert config_from_hf(load_hf_config(tmp_path)).sites()[1].window == MISTRAL_WINDOW
    assert_same_logits(tmp_path)


@pytest.mark.parametrize(("family", "extra"), [("mistral", {}), ("qwen2", {"use_sliding_window": True,
                                                                           "max_window_layers": 0})])
def test_an_absent_sliding_window_key_is_the_config_class_default_and_null_is_none(tmp_path, family, extra):
    import transformers as tf

    save_hf_model(family, tmp_path, **extra)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["sliding_window"]  # a hand-written or older config.json: transformers reads its class default
    hf.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    want = tf.AutoConfig.from_pretrained(tmp_path).sliding_window
    assert want == 4096
    assert config_from_hf(load_hf_config(tmp_path)).sites()[1].window == want
    edit_config(tmp_path, sliding_window=None)
    assert tf.AutoConfig.from_pretrained(tmp_path).sliding_window is None
    assert config_from_hf(load_hf_config(tmp_path)).sites()[1].window is None
