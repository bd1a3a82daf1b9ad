"""A spec given with --weights whose sizes differ from the checkpoint's is the spec's fault: the message names the
field, both values and the fix in the spec, rather than blaming config.json for the tensors' shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.cli.commands import main
from kiln.errors import KilnError, WeightError
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.spec_match import check_spec_matches
from kiln.hf.weights import load_hf_weights
from tests.support.hf_models import save_hf_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", d)
    return d


@pytest.mark.parametrize("field, value", [("ffn", 48), ("dim", 48), ("vocab", 300), ("layers", 3)])
def test_a_spec_size_that_differs_from_the_checkpoint_names_the_field(llama, field, value):
    cfg = config_from_hf(load_hf_config(llama))
    with pytest.raises(KilnError) as e:
        check_spec_matches(dataclasses.replace(cfg, **{field: value}), cfg, "my.kiln", "ckpt/config.json")
    msg = str(e.value)
    want = f"my.kiln does not describe the checkpoint ckpt/config.json: {field}: {value} in the spec, "
    assert msg.startswith(want + f"{getattr(cfg, field)} in the checkpoint; fix the spec"), msg


def test_the_user_report_a_wrong_ffn_through_kiln_run(llama, tmp_path, capsys):
    spec = tmp_path / "m.kiln"
    assert main(["import", str(llama), "-o", str(spec)]) == 0
    assert "ffn = 64" in spec.read_text()
    spec.write_text(spec.read_text().replace("ffn = 64", "ffn = 48"))
    code = main(["run", str(spec), "--weights", str(llama), "--prompt-ids", "3,4", "--max-tokens", "1"])
    err = capsys.readouterr()[1]
    assert code == 2 and "ffn: 48 in the spec, 64 in the checkpoint; fix the spec" in err, err
    assert "config.json does not describe these tensors" not in err and "Traceback" not in err, err


def test_learned_positions_compare_the_context(llama, tmp_path):
    # GPT-2's position table has one row per position: a spec serving another context cannot use its tensor
    save_hf_model("gpt2", tmp_path / "g")
    cfg = config_from_hf(load_hf_config(tmp_path / "g"))
    with pytest.raises(KilnError, match="context: 32 in the spec, 64 in the checkpoint; fix the spec"):
        check_spec_matches(dataclasses.replace(cfg, context=32), cfg, "g.kiln", "g/config.json")
    # a rope model's context is free (a spec may serve a shorter one); positions that differ name no context
    rope = config_from_hf(load_hf_config(llama))
    check_spec_matches(dataclasses.replace(rope, context=32), rope, "l.kiln", "l/config.json")
    with pytest.raises(KilnError) as e:
        check_spec_matches(dataclasses.replace(cfg, positions="none"), cfg, "g.kiln", "g/config.json")
    assert "positions: none in the spec, learned in the checkpoint" in str(e.value)
    assert "context" not in str(e.value), str(e.value)


def test_the_shape_hint_names_config_json_and_the_spec(llama, tmp_path):
    # reached with a spec only when it agrees with config.json (spec_match runs first): both must change
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(65, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    with pytest.raises(WeightError) as e:
        load_hf_weights(tmp_path, config_from_hf(load_hf_config(llama)), model_type="llama")
    hint = str(e.value).split("hint: ")[1]
    assert "they come from config.json" in hint and "and from the spec when one is given with the weights" in hint
    assert "use the config.json saved with these weights, and a spec that matches it" in hint, hint
