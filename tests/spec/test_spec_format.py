"""The canonical form: a golden output, idempotence on the bundled specs, and parse(format(ast)) == ast."""

from __future__ import annotations

from importlib.resources import files

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    SpecFile,
    Str,
)
from kiln.spec.formatter import format_expr, format_spec
from kiln.spec.loader import bundled_specs
from kiln.spec.parser import parse_spec

MESSY = """\
# comments survive formatting
model "tiny"{vocab=512 dim   =  64 layers = 2_0
     norm=rms( eps=1e-5 ) rope = rope(theta = 1e4,scaling=linear(factor=2,),)
  layer{ h=norm(x) x=x+attention(h,causal=true,window=8)+mlp((h),act=swiglu)
  }
  tie_embeddings=false   name = "a\\tb"  shift = -1.5
}
compile{dtype=bf16}
"""

GOLDEN = """\
# comments survive formatting
model "tiny" {
  vocab = 512
  dim = 64
  layers = 20
  norm = rms(eps = 1e-05)
  rope = rope(theta = 10000.0, scaling = linear(factor = 2))

  layer {
    h = norm(x)
    x = x + attention(h, causal = true, window = 8) + mlp(h, act = swiglu)
  }

  tie_embeddings = false
  name = "a\\tb"
  shift = -1.5
}

compile {
  dtype = bf16
}
"""


def test_golden_canonical_form():
    assert format_spec(parse_spec(MESSY)) == GOLDEN
    assert parse_spec(GOLDEN) == parse_spec(MESSY)


def test_parentheses_only_where_needed():
    a, b, c = Name("a"), Name("b"), Name("c")
    assert format_expr(BinOp("+", BinOp("+", a, b), c)) == "a + b + c"
    assert format_expr(BinOp("+", a, BinOp("+", b, c))) == "a + (b + c)"
    assert format_expr(BinOp("*", BinOp("+", a, b), c)) == "(a + b) * c"
    assert format_expr(BinOp("+", a, BinOp("*", b, c))) == "a + b * c"
    assert format_expr(Call("f", (Num(-2),), (Keyword("k", Num(0.1)),))) == "f(-2, k = 0.1)"


def test_non_finite_numbers_are_refused():
    with pytest.raises(ValueError, match="finite"):
        format_expr(Num(float("inf")))


@pytest.mark.parametrize("name", bundled_specs())
def test_format_is_idempotent_on_bundled_specs(name):
    source = files("kiln.specs").joinpath(f"{name}.kiln").read_text()
    ast = parse_spec(source)
    once = format_spec(ast)
    assert parse_spec(once) == ast
    assert format_spec(parse_spec(once)) == once
    assert once == source  # the bundled files are canonical, comments included


# ---- property: any AST survives format -> parse --------------------------------------------------------------

RESERVED = {"model", "layer", "compile", "true", "false"}
# Names from a small alphabet generate far faster than from_regex; keywords cannot be names where they fit.
names = st.builds(lambda head, tail: head + tail, st.sampled_from("abfltxAZ_"), st.text("aelmortux_09Z", max_size=6)) \
    .filter(lambda s: s not in RESERVED)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
leaves = st.one_of(
    st.builds(Num, st.integers(-(10**12), 10**12)),
    st.builds(Num, st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(Bool, st.booleans()),
    st.builds(Str, texts),
    st.builds(Name, names),
)


def _compound(children):
    args = st.lists(children, max_size=3).map(tuple)
    kwargs = st.lists(st.builds(Keyword, names, children), max_size=3).map(tuple)
    return st.one_of(
        st.builds(BinOp, st.sampled_from(["+", "*"]), children, children),
        st.builds(Call, names, args, kwargs),
    )


exprs = st.recursive(leaves, _compound, max_leaves=6)
setting_lists = st.lists(st.builds(Setting, names, exprs), max_size=3).map(tuple)
layers = st.builds(LayerBlock, st.lists(st.builds(Assign, names, exprs), max_size=3).map(tuple))
models = st.builds(ModelBlock, texts, st.lists(st.one_of(st.builds(Setting, names, exprs), layers), max_size=4)
                   .map(tuple))
spec_files = st.builds(SpecFile, models, st.none() | st.builds(CompileBlock, setting_lists))


@settings(max_examples=200, deadline=None)
@given(spec_files)
def test_parse_of_format_is_identity(ast):
    text = format_spec(ast)
    assert parse_spec(text) == ast
    assert format_spec(parse_spec(text)) == text
