"""The `speculation` compile key and its other spellings (flag text, dict, SpeculationConfig): what each resolves to,
their errors (message, line:col, hint), relative draft paths, `kiln fmt` and `kiln check`."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.cli.commands import main
from kiln.errors import SpecError, UsageError
from kiln.model_config import SpeculationConfig
from kiln.spec.formatter import format_spec
from kiln.spec.loader import load_spec, parse_and_resolve
from kiln.spec.parser import parse_spec
from kiln.spec.speculation import check_layers, describe, parse_speculation, speculation_config
from tests.support.spec_errors import BASE, edit, only

S = SpeculationConfig


def with_key(value: str) -> str:
    return edit("  dtype = fp32\n", f"  dtype = fp32\n  speculation = {value}\n")


def resolved(value: str, path: str = "t.kiln") -> SpeculationConfig | None:
    return parse_and_resolve(with_key(value), path).compile.extra.get("speculation")


VALID = {
    "ngram": S("ngram"),
    "ngram(n = 3, k = 4)": S("ngram", k=4, n=3),
    "ngram(n = 1, k = 16)": S("ngram", k=16, n=1),
    "self(layers = 1)": S("self", layers=1),
    "self(layers = 1, k = 2)": S("self", k=2, layers=1),
    'draft(spec = "/abs/draft.kiln", k = 5)': S("draft", k=5, spec="/abs/draft.kiln"),
    'draft(weights = "/ckpt/small")': S("draft", weights="/ckpt/small"),
}


@pytest.mark.parametrize("value", VALID)
def test_valid_values_resolve_to_a_speculation_config(value):
    assert resolved(value) == VALID[value]
    assert parse_speculation(value) == VALID[value]  # the flag's text means the same


def test_off_and_no_key_mean_no_speculation():
    assert resolved("off") is None
    assert "speculation" not in parse_and_resolve(BASE, "t.kiln").compile.extra
    assert parse_speculation("off") is None and parse_speculation("  off ") is None


# (value, message, column, text the hint contains); the setting is on line 18, the value starts at column 17
ERRORS = {
    "k zero": ("ngram(k = 0)", "k must be a positive integer, got 0", 27, "at least 1"),
    "k too big": ("ngram(k = 17)", "k = 17 is above the largest kiln can build, 16", 27, "2 to 8 is usual"),
    "n zero": ("ngram(n = 0)", "n must be a positive integer, got 0", 27, "at least 1"),
    "n float": ("ngram(n = 2.5)", "n must be a positive integer, got 2.5", 27, "whole number"),
    "self without layers": ("self(k = 4)", "self() needs `layers = ...`", 17, "self(layers = 2, k = 4)"),
    "layers = model layers": ("self(layers = 2)", "self(layers = 2) must use fewer layers than the model's 2", 31,
                              "1 <= L < 2"),
    "layers zero": ("self(layers = 0)", "layers must be a positive integer, got 0", 31, "at least 1"),
    "draft with nothing": ("draft(k = 4)", "draft() needs `spec = ...` and/or `weights = ...`", 17, "draft(spec ="),
    "draft spec not a string": ("draft(spec = tiny)", "spec must be a file or directory name in quotes, got tiny", 30,
                                'spec = "tiny-llama"'),
    "draft empty weights": ('draft(weights = "")', 'weights must be a file or directory name in quotes, got ""', 33,
                            'weights = "draft-dir/"'),
    "unknown kind": ("medusa(k = 4)", "unknown speculation `medusa`", 17, "self(layers = L, k = 4), draft("),
    "unknown name": ("of", "unknown speculation `of`; did you mean `off`?", 17, ", or off"),
    "unknown argument": ("ngram(m = 3)", "unknown argument `m` to ngram()", 23, "ngram() takes: n, k"),
    "argument of another kind": ("self(layers = 1, n = 3)", "unknown argument `n` to self()", 34, "layers, k"),
    "not a call": ("4", "speculation must be a call like ngram(n = 3, k = 4), got 4", 17, "speculation = ngram("),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_point_at_the_value(case):
    value, message, column, hint = ERRORS[case]
    text = with_key(value)
    d = only(text)
    assert (d.message, d.path, d.line, d.column) == (message, "t.kiln", 18, column)
    assert hint in d.hint
    assert d.source_line == text.splitlines()[17]


def test_one_layer_model_hint_names_the_other_drafters():
    text = with_key("self(layers = 1)").replace("layers = 2\n", "layers = 1\n", 1)
    d = only(text)
    assert "fewer layers than the model's 1" in d.message and "use ngram(...) or draft(...)" in d.hint


def test_flag_errors_point_into_the_flag_text():
    with pytest.raises(SpecError) as info:
        parse_speculation("ngram(n = 3, k = 99)", "--speculation")
    (d,) = info.value.diagnostics
    assert (d.path, d.line, d.column, d.source_line) == ("--speculation", 1, 18, "ngram(n = 3, k = 99)")
    assert "--speculation:1:18: error: k = 99 is above" in str(info.value)
    with pytest.raises(SpecError) as info:  # a syntax error, too, in a value's words rather than a file's
        parse_speculation("ngram(n = 3,, k = 4)")
    (d,) = info.value.diagnostics
    assert (d.column, d.message) == (13, "unexpected `,`, expected a value or `)`")
    assert d.hint.startswith("write one value in the spec syntax")
    with pytest.raises(SpecError, match=r"--speculation:1:14: error: unexpected end of text, expected `,` or `\)`"):
        parse_speculation("self(layers=2")


def test_dict_and_config_forms_are_validated_like_the_text():
    assert speculation_config({"kind": "self", "layers": 2, "k": 3}) == S("self", k=3, layers=2)
    assert speculation_config({"kind": "draft", "spec": "tiny-llama"}) == S("draft", spec="tiny-llama")
    assert speculation_config("ngram(n = 2)") == S("ngram", n=2)
    assert speculation_config(S("ngram", k=2, n=5)) == S("ngram", k=2, n=5)
    assert speculation_config(None) is None and speculation_config("off") is None
    with pytest.raises(SpecError, match=r"speculation:1:11: error: k = 40 is above"):
        speculation_config({"kind": "ngram", "k": 40})
    with pytest.raises(SpecError, match=r"layers must be a positive integer, got 0"):
        speculation_config(S("self"))  # the config's default layers = 0 is not a self drafter
    with pytest.raises(UsageError, match=r"needs 'kind', one of ngram, self, draft"):
        speculation_config({"n": 3})
    with pytest.raises(UsageError, match=r"values are numbers or strings"):
        speculation_config({"kind": "self", "layers": [2]})
    with pytest.raises(UsageError, match=r"must be a SpeculationConfig, text like"):
        speculation_config(3)


def test_check_layers_against_the_loaded_model():
    model = load_spec("tiny-llama").model
    check_layers(S("self", layers=model.layers - 1), model)
    check_layers(S("ngram"), model)
    with pytest.raises(UsageError, match=rf"self\(layers = {model.layers}, k = 4\): the self drafter must use fewer"):
        check_layers(S("self", layers=model.layers), model)


def test_relative_draft_paths_start_at_the_spec_file(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "small").write_text("")  # a file beside the spec wins over a bundled name
    spec = tmp_path / "specs" / "main.kiln"
    spec.write_text(with_key('draft(spec = "draft.kiln", weights = "../ckpt", k = 3)'))
    got = load_spec(spec).compile.extra["speculation"]
    assert got == S("draft", k=3, spec=str(spec.parent / "draft.kiln"), weights=str(spec.parent / "../ckpt"))
    spec.write_text(with_key('draft(spec = "tiny-llama")'))  # a bare name with no such file: a bundled spec
    assert load_spec(spec).compile.extra["speculation"].spec == "tiny-llama"
    spec.write_text(with_key('draft(spec = "small")'))
    assert load_spec(spec).compile.extra["speculation"].spec == str(spec.parent / "small")
    assert parse_speculation('draft(spec = "d.kiln", weights = "w")') == S("draft", spec="d.kiln", weights="w")


def test_fmt_writes_the_canonical_form_and_it_reads_back():
    text = with_key('draft(  spec="tiny-llama" ,weights = "w/",k=4 )')
    canonical = format_spec(parse_spec(text))
    assert '  speculation = draft(spec = "tiny-llama", weights = "w/", k = 4)\n' in canonical
    assert parse_spec(canonical) == parse_spec(text)
    assert resolved('draft(spec = "tiny-llama", weights = "/w", k = 4)') == S("draft", spec="tiny-llama", weights="/w")


def test_kiln_fmt_rewrites_the_key(tmp_path, capsys):
    spec = tmp_path / "s.kiln"
    spec.write_text(with_key("self( layers=1 ,k=2)"))
    assert main(["fmt", str(spec)]) == 0
    assert "  speculation = self(layers = 1, k = 2)\n" in capsys.readouterr().out


def test_describe_is_the_canonical_text():
    for value, cfg in VALID.items():
        if "(" in value:
            assert parse_speculation(describe(cfg)) == cfg
    assert describe(S("self", layers=2, k=3)) == "self(layers = 2, k = 3)"


def test_kiln_check_reports_the_speculation(tmp_path, capsys):
    spec = tmp_path / "s.kiln"
    spec.write_text(with_key("self(layers = 1, k = 3)"))
    assert main(["check", str(spec)]) == 0
    assert "speculation self(layers = 1, k = 3)" in capsys.readouterr().out
    spec.write_text(with_key("self(layers = 9)"))
    assert main(["check", str(spec)]) == 2
    assert "s.kiln:18:31: error: self(layers = 9) must use fewer layers than the model's 2" in capsys.readouterr().err


def test_config_fields_keep_their_meaning():
    cfg = resolved("ngram(n = 2, k = 3)")
    assert dataclasses.asdict(cfg) == {"kind": "ngram", "k": 3, "n": 2, "layers": 0, "spec": "", "weights": ""}
