"""Every kind of spec error: message text and exact line:column, and that all errors of a file come together."""

from __future__ import annotations

import pytest

from kiln.errors import SpecError
from kiln.spec.loader import parse_and_resolve
from tests.support.spec_errors import BASE, diagnostics, edit, only


def test_base_is_valid():
    loaded = parse_and_resolve(BASE, "t.kiln")
    assert loaded.model.head_dim == 16 and loaded.model.kv_heads == 2


# (edit, expected message, line, column, text the hint contains)
CASES = {
    "syntax error": (("  layers = 2", "  layers 2"), "unexpected `2`, expected `=`", 4, 10, "name = value"),
    "unknown key": (("  kv_heads = 2", "  kv_head = 2"), "unknown model setting `kv_head`; did you mean `kv_heads`?",
                    6, 3, "model settings are"),
    "unknown op": (("mlp(norm(x)", "mpl(norm(x)"), "unknown layer op `mpl`; did you mean `mlp`?", 13, 13, "mlp()"),
    "unknown kwarg": (("causal = true", "casual = true"),
                      "unknown argument `casual` to attention(); did you mean `causal`?", 12, 32, "causal, window"),
    "duplicate key": (("  heads = 4\n", "  heads = 4\n  dim = 64\n"),
                      "duplicate model setting `dim` (first set on line 3)", 6, 3, "remove one"),
    "wrong type": (("heads = 4", "heads = 2.5"), "heads must be a positive integer, got 2.5", 5, 11, "whole number"),
    "heads % kv_heads": (("kv_heads = 2", "kv_heads = 3"), "heads (4) must be divisible by kv_heads (3)", 6, 3,
                         "divides heads"),
    "dim != heads * head_dim": (("dim = 64", "dim = 66"), "dim (66) must equal heads (4) * head_dim", 3, 3,
                                "set head_dim explicitly to decouple head size from dim"),
    "window < 1": (("causal = true", "window = 0"), "window must be a positive integer, got 0", 12, 41, "window"),
    "zero size": (("vocab = 512", "vocab = 0"), "vocab must be a positive integer, got 0", 2, 11, "at least 1"),
    "negative size": (("layers = 2", "layers = -2"), "layers must be a positive integer, got -2", 4, 12, "at least 1"),
    "missing required key": (("  context = 256\n", ""), "model `t` is missing the required setting `context`", 1, 1,
                             "add `context = "),
    "unknown enum": (("act = swiglu", "act = swiglo"), "unknown activation `swiglo`; did you mean `swiglu`?", 13, 32,
                     "act is one of"),
    "model key in the compile block": (("  dtype = fp32\n", "  dtype = fp32\n  routing = mod(capacity = 0.5)\n"),
                                       "Mixture-of-Depths routing is a model setting, `route`, not a compile "
                                       "setting: it changes what the model computes", 18, 3,
                                       "move it into the model block"),
    "undefined name": (("mlp(norm(x)", "mlp(norm(h)"), "undefined name `h` in the layer block", 13, 22,
                       "assigned before it is used"),
    "unknown compile key": (("dtype = fp32", "dtyp = fp32"), "unknown compile setting `dtyp`; did you mean `dtype`?",
                            17, 3, "dtype"),
    "positions = rope without rope": (("  rope = rope(theta = 10000)", "  positions = rope"),
                                      "positions = rope needs a rope setting", 10, 3, "rope(theta"),
    "rope with learned positions": (("  rope = rope(theta = 10000)", "  rope = rope(theta = 1)  positions = learned"),
                                    "rope is set but positions = learned", 10, 27, "remove the rope setting"),
    "eps not positive": (("eps = 1e-5", "eps = 0.0"), "eps must be a positive number, got 0.0", 9, 20, "eps"),
    "unknown norm": (("rms(eps", "rsm(eps"), "unknown norm `rsm`; did you mean `rms`?", 9, 10, "rms(...)"),
    "two inputs": (("attention(norm(x),", "attention(norm(x), x,"),
                   "attention() takes exactly one positional argument (its input), got 2", 12, 13, "attention(x)"),
    "mlp without act": ((", act = swiglu", ""), "mlp() needs `act = ...`", 13, 13, "act"),
    "x never assigned": (("    x = x + mlp", "    y = x + mlp"),
                         "`y` is assigned after the last assignment to `x` and never reaches the layer's output",
                         13, 5, "end the layer block"),
    "bool expected": (("causal = true", "causal = 1"), "causal must be true or false, got 1", 12, 41, "true"),
    # kiln generates left to right over a KV cache: the engine gave other tokens than the uncached reference
    "causal = false": (("causal = true", "causal = false"), "attention(causal = false) cannot be served: kiln "
                       "generates left to right over a KV cache, and a cached token cannot attend to tokens that "
                       "come after it", 12, 41, "drop `causal = false`"),
    # rope = true in a model without rope ran with no positions at all
    "rope = true without rope": (("  rope = rope(theta = 10000)\n  layer {\n"
                                  "    x = x + attention(norm(x), causal = true)",
                                  "  layer {\n    x = x + attention(norm(x), rope = true)"),
                                 "attention(rope = true) but the model has no rotary embedding (positions = none)",
                                 11, 39, "add e.g. `rope = rope(theta = 10000)`"),
    # rotate-half needs pairs: head_dim 7 passed check and crashed in run
    "odd head_dim with rope": (("  kv_heads = 2\n", "  kv_heads = 2\n  head_dim = 7\n"),
                               "rope needs an even head_dim, but head_dim is 7", 7, 3, "head_dim = 8"),
    "odd derived head_dim with rope": (("dim = 64", "dim = 60"),
                                       "rope needs an even head_dim, but head_dim is 15 (dim 60 / heads 4)", 3, 3,
                                       "pick an even head_dim"),
    # the name is the served model id: an empty one, or one that breaks lines, was accepted
    "empty model name": (('model "t"', 'model ""'), "the model name is empty", 1, 1, 'model "my-llama"'),
    "model name with a newline": (('model "t"', 'model "a\\nb"'),
                                  "the model name 'a\\nb' contains a control character (a newline, tab, ...)", 1, 1,
                                  "one-line name"),
    # an unread assignment built dead ops whose weights became required checkpoint tensors
    "unused variable": (("    x = x + attention", "    h = norm(x)\n    x = x + attention"),
                        "`h` is assigned but never used", 12, 5, "remove the assignment"),
    # attention(qk_norm = rms): Qwen3's per-head q/k norm, whose eps is the model norm's
    "unknown qk_norm": (("causal = true", "qk_norm = rsm"), "unknown qk_norm `rsm`; did you mean `rms`?", 12, 42,
                        "`qk_norm = rms` normalizes each head of q and k"),
    "qk_norm not a norm kind": (("causal = true", "qk_norm = true"), "qk_norm must be rms, got true", 12, 42,
                                "leave it out for no q/k norm"),
    "qk_norm with its own eps": (("causal = true", "qk_norm = rms(eps = 1e-6)"),
                                 "qk_norm = rms takes no arguments: the q/k norm uses the eps of the model's `norm`",
                                 12, 42, "the model norm's eps"),
    "overwritten before use": (("    x = x + attention(norm(x), causal = true)",
                                "    h = norm(x)\n    h = norm(x)\n    x = x + attention(h, causal = true)"),
                               "`h` is assigned but never used", 12, 5, "remove the assignment"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_error(case):
    (old, new), message, line, column, hint = CASES[case]
    d = only(edit(old, new))
    assert d.message == message
    assert (d.path, d.line, d.column) == ("t.kiln", line, column)
    assert hint in d.hint
    assert d.source_line == edit(old, new).splitlines()[line - 1]


def test_rendered_diagnostic_has_location_source_caret_and_hint():
    text = edit("vocab = 512", "vocab = 0")
    with pytest.raises(SpecError) as info:
        parse_and_resolve(text, "t.kiln")
    assert str(info.value).splitlines() == [
        "t.kiln:2:11: error: vocab must be a positive integer, got 0",
        "      vocab = 0",
        "              ^",
        "  hint: vocab counts something, so it is at least 1",
    ]


def test_syntax_errors_speak_plain_words_not_token_names():
    d = only('model "t" {\n  vocab = 1\n')
    assert d.message == "unexpected end of file, expected `layer`, a name, `+`, `}` or `*`"
    assert (d.line, d.column) == (2, 12)
    assert "`{` needs a matching `}`" in d.hint
    for text in ('model "t" { a = }', 'model "t" { a = 1, b = 2 }', "model t {}", "", 'model "t" { a = 1; }'):
        rendered = str(pytest.raises(SpecError, parse_and_resolve, text).value)
        assert not any(tok in rendered for tok in ("RBRACE", "LBRACE", "EQUAL", "COMMA", "$END", "NAME", "STRING"))


def test_x_must_be_assigned_at_all():
    text = edit("    x = x + attention(norm(x), causal = true)\n    x = x + mlp(norm(x), act = swiglu)\n",
                "    h = norm(x)\n")
    d = only(text)
    assert d.message == "the layer block never assigns `x`"
    assert (d.line, d.column) == (11, 3)


def test_three_independent_errors_are_reported_together():
    text = edit("vocab = 512", "vocab = 0").replace("act = swiglu", "act = swiglo").replace("fp32", "fp64")
    diags = diagnostics(text)
    assert [(d.line, d.column) for d in diags] == [(2, 11), (13, 32), (17, 11)]
    assert diags[0].message == "vocab must be a positive integer, got 0"
    assert diags[1].message.startswith("unknown activation `swiglo`")
    assert diags[2].message == "unknown dtype `fp64`; did you mean `fp16`?"
    assert str(pytest.raises(SpecError, parse_and_resolve, text).value).count("error:") == 3
