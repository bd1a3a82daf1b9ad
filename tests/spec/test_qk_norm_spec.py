"""attention(qk_norm = rms): Qwen3's per-head q/k norm in the spec language: resolved, its weights in the
param_shapes contract, `kiln fmt` canonical and round-tripping, `kiln check` accepting it."""

from __future__ import annotations

from kiln.cli import main
from kiln.hf.to_spec import config_to_spec
from kiln.model_config import AttentionCall, param_shapes
from kiln.spec.formatter import format_spec
from kiln.spec.loader import parse_and_resolve
from kiln.spec.parser import parse_spec

SPEC = """\
# a Qwen3-shaped model: head_dim 24 is not dim / heads
model "q" {
  vocab = 64
  dim = 32
  layers = 2
  heads = 4
  kv_heads = 2
  head_dim = 24
  ffn = 64
  context = 32
  norm = rms(eps = 1e-06)
  rope = rope(theta = 1000000)

  layer {
    x = x + attention(norm(x), causal = true, qk_norm = rms)  # q and k normalized per head, before rope
    x = x + mlp(norm(x), act = swiglu)
  }
}
"""


def _attention(text: str) -> AttentionCall:
    return next(s for s in parse_and_resolve(text).model.sites() if isinstance(s, AttentionCall))


def test_qk_norm_resolves_and_adds_two_head_dim_weights_per_layer():
    model = parse_and_resolve(SPEC).model
    assert _attention(SPEC).qk_norm == "rms"
    shapes = param_shapes(model)
    for i in range(model.layers):
        assert shapes[f"layers.{i}.attn0.q_norm.weight"] == shapes[f"layers.{i}.attn0.k_norm.weight"] == (24,)
    plain = SPEC.replace(", qk_norm = rms", "")
    assert _attention(plain).qk_norm is None
    qk = {n for n in shapes if n.endswith((".q_norm.weight", ".k_norm.weight"))}
    assert len(qk) == 2 * model.layers and set(param_shapes(parse_and_resolve(plain).model)) == set(shapes) - qk


def test_fmt_keeps_it_and_round_trips():
    ast = parse_spec(SPEC)
    assert format_spec(ast) == SPEC  # canonical as written, comment included
    messy = SPEC.replace("causal = true, qk_norm = rms", "qk_norm=rms ,causal=true")
    assert "qk_norm = rms, causal = true" in format_spec(parse_spec(messy))
    assert parse_spec(format_spec(parse_spec(messy))) == parse_spec(messy)


def test_kiln_check_and_fmt_accept_it(tmp_path, capsys):
    path = tmp_path / "q.kiln"
    path.write_text(SPEC)
    assert main(["check", str(path)]) == 0
    assert main(["fmt", "--check", str(path)]) == 0
    assert ": ok" in capsys.readouterr().out


def test_a_config_with_qk_norm_prints_as_a_spec_that_resolves_to_it():
    model = parse_and_resolve(SPEC).model
    text = format_spec(config_to_spec(model))
    assert "qk_norm = rms" in text
    assert parse_and_resolve(text).model == model
