"""Parsing to the typed AST (with spans) and resolving to ModelConfig."""

from __future__ import annotations

import pytest

from kiln.model_config import Add, AttentionCall, LayerAssign, MlpCall, NormCall, NormConfig, RopeScaling, Var
from kiln.spec.ast import (
    Assign,
    BinOp,
    Bool,
    Call,
    CompileBlock,
    Keyword,
    LayerBlock,
    ModelBlock,
    Name,
    Num,
    Setting,
    Span,
    SpecFile,
    Str,
)
from kiln.spec.loader import bundled_specs, load_spec, parse_and_resolve
from kiln.spec.parser import parse_spec

SNIPPET = """\
# a comment
model "m" {
  vocab = 128_256   dim = 2.5e3  shift = -3  scale = -0.5
  title = "a \\"b\\"\\n"  on = true  off = false
  norm = rms(eps = 1e-5)
  layer {
    x = x + attention(norm(x), causal = true)  # trailing comment
  }
}
compile {
  dtype = bf16
}
"""


def test_ast_of_a_known_snippet():
    spec = parse_spec(SNIPPET, "s.kiln")
    attn = Call("attention", (Call("norm", (Name("x"),)),), (Keyword("causal", Bool(True)),))
    assert spec == SpecFile(
        model=ModelBlock("m", (
            Setting("vocab", Num(128256)), Setting("dim", Num(2500.0)), Setting("shift", Num(-3)),
            Setting("scale", Num(-0.5)), Setting("title", Str('a "b"\n')), Setting("on", Bool(True)),
            Setting("off", Bool(False)), Setting("norm", Call("rms", (), (Keyword("eps", Num(1e-5)),))),
            LayerBlock((Assign("x", BinOp("+", Name("x"), attn)),)),
        )),
        compile=CompileBlock((Setting("dtype", Name("bf16")),)),
    )
    assert spec.path == "s.kiln" and spec.source == SNIPPET
    assert type(spec.model.items[0].value.value) is int and type(spec.model.items[1].value.value) is float


def test_spans_are_one_based_and_cover_the_node():
    spec = parse_spec(SNIPPET)
    assert spec.model.span == Span(2, 1, 9, 2)
    assert spec.model.items[0].span == Span(3, 3, 3, 18)  # `vocab = 128_256`
    assert spec.model.items[2].value.span == Span(3, 42, 3, 44)  # `-3` starts at the minus
    layer = spec.model.items[-1]
    assert layer.span == Span(6, 3, 8, 4)
    stmt = layer.body[0]
    assert stmt.span == Span(7, 5, 7, 46)
    call = stmt.value.right
    assert call.span == Span(7, 13, 7, 46)
    assert call.args[0].span == Span(7, 23, 7, 30)  # norm(x)
    assert call.kwargs[0].span == Span(7, 32, 7, 45)  # causal = true
    assert spec.compile.settings[0].value.span == Span(11, 11, 11, 15)


def test_precedence_and_parentheses():
    body = parse_spec('model "m" { layer { y = a + b * c + (d + e) } }').model.items[0].body[0].value
    assert body == BinOp("+", BinOp("+", Name("a"), BinOp("*", Name("b"), Name("c"))),
                         BinOp("+", Name("d"), Name("e")))


def test_keywords_are_names_where_no_keyword_fits():
    spec = parse_spec('model "m" { norm = layer(eps = 1e-5) model = compile }')
    assert spec.model.items[0].value.func == "layer"
    assert spec.model.items[1] == Setting("model", Name("compile"))


@pytest.mark.parametrize("name", bundled_specs())
def test_every_bundled_spec_parses_and_resolves(name):
    loaded = load_spec(name)
    assert loaded.model.name == name
    assert loaded.model.body[-1].target == "x"
    assert loaded.model.heads % loaded.model.kv_heads == 0


def test_llama_3_2_1b_resolves_to_its_published_config():
    m = load_spec("llama-3.2-1b").model
    assert (m.vocab, m.dim, m.layers, m.heads, m.kv_heads, m.head_dim, m.ffn, m.context) == (
        128256, 2048, 16, 32, 8, 64, 8192, 131072)
    assert m.norm == NormConfig("rms", 1e-5)
    assert m.rope.theta == 500000.0
    assert m.rope.scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert m.positions == "rope" and m.tie_embeddings and m.final_norm
    attn = m.body[0].value.right
    assert isinstance(attn, AttentionCall) and attn.causal and attn.window is None and not attn.qkv_bias
    assert m.body[1].value.right == MlpCall(NormCall(Var("x"), "norm1"), "mlp0", "swiglu")


def test_gpt2_resolves_to_its_published_config():
    m = load_spec("gpt2").model
    assert (m.vocab, m.dim, m.layers, m.heads, m.kv_heads, m.head_dim, m.ffn, m.context) == (
        50257, 768, 12, 12, 12, 64, 3072, 1024)
    assert m.norm == NormConfig("layer", 1e-5)
    assert m.rope is None and m.positions == "learned" and m.tie_embeddings
    attn, mlp = m.body[0].value.right, m.body[1].value.right
    assert attn.qkv_bias and attn.out_bias  # bias = true sets all four projections
    assert mlp.act == "gelu_tanh" and mlp.bias and not mlp.gated


HEADER = 'model "p" { vocab = 8 dim = 8 layers = 1 heads = 2 context = 8 ffn = 8 norm = rms positions = none\n'


def test_sites_in_evaluation_order_innermost_first():
    text = HEADER + "layer {\n h = norm(x)\n x = x + attention(h, qkv_bias = true) + mlp(norm(attention(norm(x))), " \
        "act = relu)\n} }"
    m = parse_and_resolve(text).model
    assert [s.site for s in m.sites()] == ["norm0", "attn0", "norm1", "attn1", "norm2", "mlp0"]
    inner = AttentionCall(NormCall(Var("x"), "norm1"), "attn1")
    assert m.body == (
        LayerAssign("h", NormCall(Var("x"), "norm0")),
        LayerAssign("x", Add(Add(Var("x"), AttentionCall(Var("h"), "attn0", qkv_bias=True)),
                             MlpCall(NormCall(inner, "norm2"), "mlp0", "relu"))),
    )
    assert m.norm == NormConfig("rms", 1e-5)  # a bare `rms` takes the default eps


def test_defaults_and_explicit_head_dim():
    text = HEADER.replace("dim = 8", "dim = 8 head_dim = 3 kv_heads = 1") + \
        "layer { x = x + attention(x, causal = true, bias = true, out_bias = false, rope = false) } }"
    m = parse_and_resolve(text).model
    assert (m.head_dim, m.kv_heads, m.ffn, m.positions) == (3, 1, 8, "none")
    assert not m.tie_embeddings and m.final_norm
    assert m.body[0].value.right == AttentionCall(Var("x"), "attn0", causal=True, qkv_bias=True, out_bias=False,
                                                  rope=False)
    assert parse_and_resolve(text.replace("ffn = 8", "")).model.ffn == 0  # no mlp(): ffn is not needed


def test_compile_block_is_optional_and_defaults_to_fp32():
    loaded = parse_and_resolve(HEADER + "layer { x = x + attention(x) } }")
    assert loaded.ast.compile is None and loaded.compile.dtype == "fp32"
