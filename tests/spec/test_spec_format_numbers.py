"""Whole-valued floats: `kiln fmt` keeps `theta = 1e4` a float (10000.0) while `kiln import` writes `theta = 10000`.

Both are canonical and both resolve to the same model, but the formatter cannot drop the `.0`: a float and an int
parse to different values where the type matters (`layers = 2.0` is refused, `layers = 2` is not), so printing
10000.0 as 10000 would let `kiln fmt` change what a spec means."""

from __future__ import annotations

import json

from kiln.cli import main
from kiln.spec.formatter import format_spec
from kiln.spec.loader import parse_and_resolve
from kiln.spec.parser import parse_spec

HF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 288,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}


def test_fmt_keeps_a_float_a_float_and_import_output_is_already_canonical(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    out = tmp_path / "m.kiln"
    assert main(["import", str(tmp_path / "hf"), "-o", str(out), "--name", "m"]) == 0
    imported = out.read_text()
    assert "theta = 10000," in imported or "theta = 10000)" in imported
    assert main(["fmt", "--check", str(out)]) == 0  # what import writes is a fixed point of fmt
    written = imported.replace("theta = 10000", "theta = 1e4")
    formatted = format_spec(parse_spec(written))
    assert "theta = 10000.0" in formatted and format_spec(parse_spec(formatted)) == formatted
    # the two spellings resolve to the same model
    assert parse_and_resolve(formatted, "a.kiln").model == parse_and_resolve(imported, "b.kiln").model


def test_fmt_does_not_turn_a_refused_float_into_an_accepted_int(tmp_path, capsys):
    path = tmp_path / "s.kiln"
    path.write_text('model "m" {\n  vocab = 64 dim = 32 layers = 2.0 heads = 4 context = 16 ffn = 64\n'
                    "  norm = rms(eps = 1e-5)\n  layer {\n    x = x + attention(norm(x))\n"
                    "    x = x + mlp(norm(x), act = swiglu)\n  }\n}\n")
    assert main(["fmt", "--write", str(path)]) == 0
    assert "layers = 2.0" in path.read_text()
    assert main(["check", str(path)]) == 2
    assert "layers must be a positive integer, got 2.0" in capsys.readouterr().err
