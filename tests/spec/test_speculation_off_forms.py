"""`off` in every form the speculation setting takes means no speculation (and overrides a spec's key): the text
`off` or `off()` (a bare name is its call, as for every other key), the dict {"kind": "off"}, None; `off` with
settings is refused saying so; and no did-you-mean ever suggests the very word that was written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.cli.commands import build_parser
from kiln.errors import KilnError, SpecError
from kiln.model_config import SpeculationConfig
from kiln.spec.loader import load_spec, parse_and_resolve
from kiln.spec.speculation import OFF, speculation_config

OFF_FORMS = [None, "off", " off ", "off()", {"kind": "off"}, SpeculationConfig("off")]  # type: ignore[arg-type]


@pytest.mark.parametrize("value", OFF_FORMS, ids=repr)
def test_every_off_form_is_no_speculation(value):
    assert speculation_config(value) is None


def _spec(setting: str) -> str:
    text = Path(load_spec("tiny-llama").path).read_text()
    return text.replace("  dtype = fp32\n", f"  dtype = fp32\n  speculation = {setting}\n")


@pytest.mark.parametrize("text", ["off", "off()"])
def test_off_in_a_spec_file_and_the_flag(text):
    assert "speculation" not in parse_and_resolve(_spec(text), "s.kiln").compile.extra
    assert build_parser().parse_args(["run", "--prompt", "x", "--speculation", text]).speculation == OFF


@pytest.mark.parametrize("value", ["off(k = 4)", {"kind": "off", "k": 4}, "off(3)"], ids=repr)
def test_off_with_settings_is_refused_saying_so(value):
    with pytest.raises(SpecError) as info:
        speculation_config(value)
    msg = str(info.value)
    assert "off takes no settings: it turns speculation off" in msg and "did you mean" not in msg
    assert "write `off` alone (or leave speculation out), or pick a drafter: ngram(n = 3, k = 4)" in msg


def test_the_dict_form_names_off_among_the_kinds():
    with pytest.raises(KilnError, match=re.escape("the dict needs 'kind', one of ngram, self, draft or 'off'")):
        speculation_config({"n": 3})


WORDS = ["off", "of", "offf", "ngram", "ngrams", "self", "selff", "draft", "drafts", "tree"]


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("form", ["{}", "{}()", "{}(k = 2)", "{}(bogus = 1)"])
def test_a_did_you_mean_never_names_the_word_written(word, form):
    text = form.format(word)
    try:
        speculation_config(text)
    except KilnError as e:
        for said in re.findall(r"did you mean `([^`]*)`", str(e)):
            assert said != word and said != "bogus", str(e)
    try:
        parse_and_resolve(_spec(text), "s.kiln")
    except KilnError as e:
        for said in re.findall(r"did you mean `([^`]*)`", str(e)):
            assert said != word and said != "bogus", str(e)


@pytest.mark.parametrize("value", ["off", {"kind": "off"}], ids=repr)
def test_off_overrides_a_spec_key_and_llm_takes_the_dict(tmp_path, value):
    from kiln.build import load_model  # loads torch: only here
    from kiln.llm import LLM
    from kiln.speculation import resolve_speculation

    path = tmp_path / "s.kiln"
    path.write_text(_spec("ngram(n = 2, k = 3)"))
    m = load_model(path, device="cpu")
    assert resolve_speculation(None, m) == SpeculationConfig("ngram", k=3, n=2)
    assert resolve_speculation(value, m) is None
    llm = LLM(str(path), speculation=value)  # the audit's LLM(speculation={"kind": "off"})
    assert llm.speculation is None and llm.engine.drafter is None


def test_a_suggestion_is_never_the_word_typed():
    from kiln.spec.values import _suggest

    assert _suggest("off", ("ngram", "self", "draft", "off")) == ""  # known, but refused where it stands
    assert _suggest("ngrm", ("ngram", "self", "draft", "off")) == "; did you mean `ngram`?"
