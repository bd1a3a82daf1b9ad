"""Schemes that do not fit a model's shapes: a plain `int4` takes the largest group dividing every K, an explicit
group that does not fit is an error, and `kiln bench perplexity` adapts or refuses its variants before any slow
work and never loses the variants already measured."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest

from kiln.build import load_model
from kiln.cli import main
from kiln.cli import perplexity as ppl
from kiln.compile.pipeline import quantize_graph
from kiln.errors import KilnError
from kiln.ir.frontend import build_graph
from kiln.ir.text import weight_bytes
from kiln.model_config import param_shapes
from kiln.quant.formats import parse_scheme
from kiln.quant.sizing import SchemeView, fitting_group, quantized_bytes, resolve_group
from kiln.spec.loader import load_spec

TINY = load_spec("tiny-llama").model  # K = 64 (dim, heads * head_dim) and 128 (ffn): group 128 does not fit


def test_a_plain_int4_takes_the_largest_group_that_fits():
    for name, label in (("int4", "int4-rtn-g64"), ("int4-gptq", "int4-gptq-g64"), ("int4-asym", "int4-rtn-g64-asym")):
        scheme, note = resolve_group(parse_scheme(name), TINY)
        assert scheme.label == label and not scheme.auto_group
        assert "K = 64" in note and label in note
    assert fitting_group([576, 1536]) == 64 and fitting_group([96]) == 32 and fitting_group([48]) is None
    wide = dataclasses.replace(TINY, dim=128, head_dim=32)
    assert resolve_group(parse_scheme("int4"), wide) == (parse_scheme("int4-g128"), None)  # 128 fits: no note


def test_an_explicit_group_is_kept():
    scheme = parse_scheme("int4-g128")
    assert resolve_group(scheme, TINY) == (scheme, None)


def test_load_model_quantizes_a_plain_int4_with_the_group_that_fits(caplog):
    caplog.set_level(logging.INFO, logger="kiln.status")  # the note is a status line (kiln.progress.say)
    m = load_model("tiny-llama", device="cpu", quantize="int4")
    assert m.compile.extra["quantize"].label == "int4-rtn-g64"
    assert "group 64 is used (int4-rtn-g64)" in caplog.text


def test_run_says_the_group_and_an_explicit_g128_stays_an_error(capsys):
    code = main(["run", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quantize", "int4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0 and "(fp32, int4-rtn-g64, random weights" in err
    code = main(["run", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quantize", "int4-g128", "--device", "cpu"])
    assert code == 2 and "K = 64 is not a multiple of 128" in capsys.readouterr().err


def test_compile_report_names_the_scheme(capsys):
    assert main(["compile", "tiny-llama", "--quantize", "int4"]) == 0
    assert "quantize (int4-rtn-g64)" in capsys.readouterr().err


def test_default_variants_that_cannot_apply_are_replaced_or_skipped_up_front():
    run, notes = ppl.plan_variants(None, TINY)
    assert run == ["fp32", "bf16", "int8", "int4-rtn-g32", "int4-rtn-g64", "int4-gptq-g32", "int4-gptq-g64"]
    assert any("int4-rtn-g128 cannot apply" in n and "running int4-rtn-g64 instead" in n for n in notes)
    run, notes = ppl.plan_variants(None, dataclasses.replace(TINY, dim=48, head_dim=12))
    assert not any("int4" in v for v in run) and sum("skipping int4" in n for n in notes) == 4  # no group fits


def test_an_explicit_variant_that_cannot_apply_is_an_error_before_anything_runs(tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    monkeypatch.setattr(ppl, "_variant_model", lambda *a, **k: pytest.fail("a variant ran before the check"))
    with pytest.raises(KilnError, match=r"--variants int4-rtn-g128: cannot apply to tiny-llama.*int4-rtn-g64"):
        ppl.run_perplexity("tiny-llama", None, text, variants=["fp32", "int4-rtn-g128"], device="cpu")
    with pytest.raises(KilnError, match="'int5' is not a variant"):
        ppl.run_perplexity("tiny-llama", None, text, variants=["fp32", "int5"], device="cpu")


def test_default_variants_run_on_a_model_whose_k_is_not_a_multiple_of_128(tmp_path, capsys, monkeypatch):
    text, out = tmp_path / "t.txt", tmp_path / "r.json"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    monkeypatch.setattr(ppl, "DEFAULT_VARIANTS", ("fp32", "int4-rtn-g128"))  # two of them keep it fast
    assert main(["bench", "perplexity", "tiny-llama", "--text", str(text), "--window", "64", "--device", "cpu",
                 "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["fp32", "int4-rtn-g64"] and "running int4-rtn-g64 instead" in result["notes"][0]
    assert "int4-rtn-g64" in capsys.readouterr().out


def test_a_failing_variant_keeps_the_results_already_measured(tmp_path, capsys, monkeypatch):
    text, out = tmp_path / "t.txt", tmp_path / "r.json"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    real = ppl._variant_model

    def flaky(spec, weights, variant, *a, **k):
        if variant == "int8":
            raise KilnError("int8 broke")
        return real(spec, weights, variant, *a, **k)

    monkeypatch.setattr(ppl, "_variant_model", flaky)
    code = main(["bench", "perplexity", "tiny-llama", "--text", str(text), "--window", "64", "--device", "cpu",
                 "--variants", "fp32,int8,bf16", "-o", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 2 and "int8 broke" in err
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["fp32"] and result["failed"] == {"variant": "int8", "error": "int8 broke"}
    assert "fp32" in stdout and "int8             failed: int8 broke" in stdout


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])  # untied; tied; biases and positions
@pytest.mark.parametrize("name", ["int8", "int4", "int4-g32-asym", "int8+lm_head", "int8+embeddings",
                                  "int4-g32+lm_head+embeddings"])
def test_the_size_from_the_config_is_what_the_quantize_pass_leaves(spec, name):
    cfg = load_spec(spec).model
    base, *flags = name.split("+")
    scheme = resolve_group(parse_scheme(base, **{f: True for f in flags}), cfg)[0]
    view = SchemeView.of(scheme.to_dict())  # what `kiln check` reads, without torch
    assert view.label == scheme.label
    # the graph also holds buffers that are not weights (the rope table): the same bytes with or without quantize
    extra = weight_bytes(build_graph(cfg)) - 4 * sum(math.prod(s) for s in param_shapes(cfg).values())
    assert quantized_bytes(cfg, 4, view) + extra == weight_bytes(quantize_graph(build_graph(cfg), scheme))
