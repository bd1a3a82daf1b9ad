"""`kiln quantize` takes the spec's own `quantize` whole (calibration file, tokens, lm_head, embeddings), needs
--quantize only when the spec has none, and a --quantize sets the format and method over the spec's scheme as
`kiln run --quantize` / LLM(quantize=) do (the spec's lm_head, embeddings and GPTQ calibration stay, said in a note).
A quantized checkpoint loaded with a spec whose own scheme differs runs as stored, with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kiln.cli.commands import main
from kiln.spec.loader import load_spec

HEAD_AND_EMBEDDINGS = "int4(group = 32, symmetric = false, lm_head = true, embeddings = true)"
GPTQ = 'int4(group = 32, method = gptq, calibration = "calib.txt", tokens = 256)'


def _spec(tmp_path: Path, quantize: str | None) -> Path:
    """tiny-llama with `quantize = <quantize>` in its compile block (a calib.txt beside it)."""
    text = Path(load_spec("tiny-llama").path).read_text()
    if quantize is not None:
        text = text.replace("  dtype = fp32\n", f"  dtype = fp32\n  quantize = {quantize}\n")
    (tmp_path / "calib.txt").write_text("a kiln fires clay into pots; the quick brown fox jumps over the dog\n" * 8)
    path = tmp_path / "model.kiln"
    path.write_text(text)
    return path


def _quantize(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["quantize", *argv, "--device", "cpu"])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _stored(out: Path) -> dict:
    return json.loads((out / "quantization.json").read_text())


def _quantized_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gm.state_dict().items() if k.endswith((".qweight", ".scales", ".zeros"))}


def test_the_specs_scheme_is_used_whole_without_the_flag(tmp_path, capsys):
    from kiln import LLM, SamplingParams

    spec, out = _spec(tmp_path, HEAD_AND_EMBEDDINGS), tmp_path / "q"
    rc, err = _quantize(capsys, str(spec), "-o", str(out))
    assert rc == 0, err
    meta = _stored(out)
    assert meta["scheme"]["lm_head"] and meta["scheme"]["embeddings"] and not meta["scheme"]["symmetric"]
    assert {"embed.weight", "lm_head.weight"} <= set(meta["weights"])
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = [{"prompt_token_ids": [5, 9, 77, 300, 12]}]
    stored, at_run_time = LLM(str(out)), LLM(str(spec))  # the checkpoint loads with its embeddings quantized
    assert stored.generate(prompt, params)[0].outputs[0].token_ids == \
        at_run_time.generate(prompt, params)[0].outputs[0].token_ids


def test_a_gptq_specs_calibration_is_kept_and_a_flag_sets_format_and_method(tmp_path, capsys):
    from kiln import LLM

    spec = _spec(tmp_path, GPTQ)
    calibration = load_spec(spec).compile.extra["quantize"]["calibration"]
    assert Path(calibration) == tmp_path / "calib.txt"  # resolved from the spec's folder
    rc, err = _quantize(capsys, str(spec), "-o", str(tmp_path / "own"))
    assert rc == 0 and f"(calibrating on {calibration})" in err
    scheme = _stored(tmp_path / "own")["scheme"]
    assert (scheme["method"], scheme["group"], scheme["calibration"], scheme["tokens"]) == ("gptq", 32, calibration,
                                                                                            256)
    rc, err = _quantize(capsys, str(spec), "--quantize", "int4-gptq-g64", "-o", str(tmp_path / "g64"))
    assert rc == 0 and f'kept from the spec: calibration = "{calibration}", tokens = 256' in err
    scheme = _stored(tmp_path / "g64")["scheme"]
    assert (scheme["group"], scheme["calibration"], scheme["tokens"]) == (64, calibration, 256)
    # `kiln run` / LLM read the flag the same way: the checkpoint holds what run-time quantization computes.
    want = _quantized_tensors(LLM(str(spec), quantize="int4-gptq-g64").step_model.gm)
    got = _quantized_tensors(LLM(str(tmp_path / "g64")).step_model.gm)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    rc, err = _quantize(capsys, str(spec), "--quantize", "int8", "-o", str(tmp_path / "int8"))
    assert rc == 0 and f"the spec's calibration file {calibration} is not used: --quantize int8 rounds" in err
    assert _stored(tmp_path / "int8")["scheme"]["calibration"] is None


def test_no_scheme_from_flag_or_spec_names_both_ways(tmp_path, capsys):
    rc, err = _quantize(capsys, str(_spec(tmp_path, None)), "-o", str(tmp_path / "q"))
    assert rc == 2 and "neither --quantize nor the spec gives one" in err
    assert "pass --quantize SCHEME" in err and "in the spec's compile block, e.g. quantize = int4(" in err
    assert not (tmp_path / "q").exists()
    rc, err = _quantize(capsys, str(_spec(tmp_path, None)), "--quantize", "gguf", "-o", str(tmp_path / "q"))
    assert rc == 2 and "needs GGUF weights" in err


def test_a_flag_over_the_spec_keeps_what_it_cannot_say_in_run_and_llm(tmp_path):
    from kiln.build import load_model

    scheme = load_model(str(_spec(tmp_path, HEAD_AND_EMBEDDINGS)), quantize="int8", device="cpu").compile.extra[
        "quantize"]
    assert (scheme.label, scheme.lm_head, scheme.embeddings) == ("int8", True, True)
    scheme = load_model(str(_spec(tmp_path, None)), quantize="int8", device="cpu").compile.extra["quantize"]
    assert (scheme.label, scheme.lm_head, scheme.embeddings) == ("int8", False, False)


def test_a_spec_whose_scheme_differs_from_the_stored_one_is_warned_about(tmp_path, capsys, caplog):
    from kiln.build import load_model

    out = tmp_path / "q"
    assert _quantize(capsys, "tiny-llama", "--quantize", "int8", "-o", str(out))[0] == 0
    with caplog.at_level(logging.WARNING, logger="kiln"):
        m = load_model(str(_spec(tmp_path, HEAD_AND_EMBEDDINGS)), out, device="cpu")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("asks for quantize int4-rtn-g32-asym, lm_head = true, embeddings = true" in w
               and f"{out} was quantized by `kiln quantize` with int8: it runs as stored" in w for w in warned)
    assert m.quantize_label() == "int8" and "quantize" not in m.compile.extra  # nothing quantized again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        load_model(str(_spec(tmp_path, "int8")), out, device="cpu")
    assert not [r for r in caplog.records if "asks for quantize" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):  # the flag matches the label, but the spec's head stays
        load_model(str(_spec(tmp_path, "int8(lm_head = true)")), out, device="cpu", quantize="int8")
    assert any("asks for quantize int8, lm_head = true" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", [None, "int8"])
def test_a_quantized_source_is_refused_with_or_without_the_flag(tmp_path, capsys, flag):
    out = tmp_path / "q"
    assert _quantize(capsys, "tiny-llama", "--quantize", "int8", "-o", str(out))[0] == 0
    rc, err = _quantize(capsys, "--weights", str(out), *(["--quantize", flag] if flag else []), "-o",
                        str(tmp_path / "again"))
    assert rc == 2 and "is already a `kiln quantize` output" in err and "None" not in err
