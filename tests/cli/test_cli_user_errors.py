"""Regressions from a user tester's report: commands that failed, or accepted what a later command refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli.commands import main

TINY = """\
model "t" {
  vocab = 256 dim = 64 layers = 2 heads = 4 kv_heads = 2 ffn = 128 context = 64
  norm = rms(eps = 1e-5)
  rope = rope(theta = 10000)
  layer {
    x = x + attention(norm(x))
    x = x + mlp(norm(x), act = swiglu)
  }
}
"""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compile_builds_gptq_specs_and_flags(capsys, tmp_path):
    # GPTQ's graph is RTN's: compile on meta tensors used to fail asking for real weights
    spec = tmp_path / "g.kiln"
    spec.write_text(TINY + "compile { quantize = int4(group = 32, method = gptq) }\n")
    code, _, err = run_cli(capsys, "compile", str(spec))
    assert code == 0, err
    assert "quantize (int4-gptq-g32)" in err and "GPTQ calibrates when weights load" in err
    code, _, err = run_cli(capsys, "compile", "tiny-llama", "--quantize", "int4-gptq-g32")
    assert code == 0, err
    assert "quantize (int4-gptq-g32)" in err


def _check(capsys, tmp_path, text: str) -> tuple[int, str]:
    spec = tmp_path / "s.kiln"
    spec.write_text(text)
    code, _, err = run_cli(capsys, "check", str(spec))
    return code, err


def test_check_refuses_an_explicit_group_that_does_not_divide_k(capsys, tmp_path):
    code, err = _check(capsys, tmp_path, TINY + "compile {\n  quantize = int4(group = 128)\n}\n")
    assert code == 2
    assert "s.kiln:11:27: error: int4 group 128 does not divide layers.0.attn0.q.weight's K = 64" in err
    assert "use group = 64" in err
    assert _check(capsys, tmp_path, TINY + "compile { quantize = int4 }\n")[0] == 0  # no group: one that fits


@pytest.mark.parametrize("quantize", ["int4", "int4(group = 32)"])
def test_check_refuses_int4_where_no_group_fits(capsys, tmp_path, quantize):
    """dim 48: K = 48 is no multiple of 32, so no int4 group fits, whatever the spec asks (a plain int4 too)."""
    tiny = TINY.replace("dim = 64", "dim = 48")
    code, err = _check(capsys, tmp_path, tiny + f"compile {{\n  quantize = {quantize}\n}}\n")
    assert code == 2 and "s.kiln:11:14: error: no int4 group fits layers.0.attn0.q.weight: its K = 48 is not a " \
        "multiple of 32, the smallest int4 group" in err and "use quantize = int8" in err
    assert _check(capsys, tmp_path, tiny + "compile { quantize = int8 }\n")[0] == 0


def test_check_refuses_a_missing_calibration_file_from_the_spec_folder(capsys, tmp_path):
    text = TINY + 'compile {\n  quantize = int4(method = gptq, calibration = "calib.txt")\n}\n'
    code, err = _check(capsys, tmp_path, text)
    assert code == 2 and f"s.kiln:11:48: error: calibration file {tmp_path / 'calib.txt'} does not exist" in err
    # round-to-nearest never reads it: a setting that would be silently unused is refused, naming the fix
    code, err = _check(capsys, tmp_path, text.replace("method = gptq", "method = rtn"))
    assert code == 2 and "calibration is read only by GPTQ calibration" in err and "add method = gptq" in err
    (tmp_path / "calib.txt").write_text("some text")
    assert _check(capsys, tmp_path, text)[0] == 0


def test_check_refuses_speculation_with_a_routed_model(capsys, tmp_path):
    routed = TINY.replace("layers = 2", "layers = 4").replace("  rope =", "  route = mod(capacity = 0.5)\n  rope =")
    assert _check(capsys, tmp_path, routed)[0] == 0
    code, err = _check(capsys, tmp_path, routed + "compile {\n  speculation = ngram(n = 2, k = 2)\n}\n")
    assert code == 2 and "s.kiln:12:3: error: speculation with a Mixture-of-Depths model" in err


def test_check_says_a_model_without_attention_cannot_be_served(capsys, tmp_path):
    code, err = _check(capsys, tmp_path, TINY.replace("    x = x + attention(norm(x))\n", ""))
    assert code == 2 and "s.kiln:1:1: error: model `t` has no attention" in err and "cannot serve it" in err


def test_emit_replaces_an_earlier_emit_and_keeps_other_files(capsys, tmp_path):
    out = tmp_path / "emit"
    assert run_cli(capsys, "compile", "tiny-gpt2", "--emit", str(out))[0] == 0
    (out / "notes.txt").write_text("mine")
    gpt2 = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    assert run_cli(capsys, "compile", "tiny-llama", "--emit", str(out))[0] == 0
    llama = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    code, _, _ = run_cli(capsys, "compile", "tiny-llama", "--emit", str(tmp_path / "fresh"))
    fresh = {p.relative_to(tmp_path / "fresh") for p in (tmp_path / "fresh").rglob("*") if p.is_file()}
    assert llama == fresh | {Path("notes.txt")} and gpt2 != llama  # gpt2's kernels and graphs are gone
    assert (out / "notes.txt").read_text() == "mine"


def test_emit_refuses_a_directory_whose_graphs_kiln_did_not_write(capsys, tmp_path):
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "mine.txt").write_text("mine")
    code, _, err = run_cli(capsys, "compile", "tiny-llama", "--emit", str(tmp_path))
    assert code == 2 and "holds graphs/ that an earlier `kiln compile --emit` did not write" in err
    assert (tmp_path / "graphs" / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1"])
def test_prompt_ids_with_an_empty_item_are_refused(capsys, ids):
    with pytest.raises(SystemExit) as info:  # argparse refuses the flag's value: exit 2
        main(["run", "--prompt-ids", ids, "--max-tokens", "1"])
    assert info.value.code == 2 and "has an empty item (two commas in a row" in capsys.readouterr().err


def test_fmt_speaks_like_check_about_directories_and_bundled_names(capsys, tmp_path):
    (tmp_path / "d.kiln").mkdir()
    for cmd in ("fmt", "check"):
        code, _, err = run_cli(capsys, cmd, str(tmp_path / "d.kiln"))
        assert code == 2 and "is a directory, not a spec file" in err, (cmd, err)
    code, out, _ = run_cli(capsys, "fmt", "tiny-llama")
    assert code == 0 and 'model "tiny-llama"' in out
    assert run_cli(capsys, "fmt", "--check", "tiny-llama")[0] == 0
    code, _, err = run_cli(capsys, "fmt", "--write", "tiny-llama")
    assert code == 2 and "is a bundled spec" in err
    code, _, err = run_cli(capsys, "fmt", "no-such-spec")
    assert code == 2 and "no such spec file or bundled spec" in err


def test_import_of_a_file_asks_for_its_directory(capsys, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    code, _, err = run_cli(capsys, "import", str(tmp_path / "model.safetensors"))
    assert code == 2 and "is a file; give the checkpoint directory that holds it" in err and str(tmp_path) in err


def test_load_errors_read_right_from_the_python_api(tmp_path):
    # they named only CLI flags (`--dtype 'fp64' is not supported`), which LLM(...) users never typed
    from kiln.build import load_model
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match=r"^dtype 'fp64' \(--dtype\) is not supported"):
        load_model("tiny-llama", dtype="fp64", device="cpu")
    with pytest.raises(KilnError, match=r"^weights .*nope \(--weights\): does not exist"):
        load_model("tiny-llama", weights=tmp_path / "nope", device="cpu")


def test_a_pool_too_small_names_only_flags_that_kiln_run_has(capsys):
    code, _, err = run_cli(capsys, "run", "--num-blocks", "1", "--prompt-ids", "1,2", "--max-tokens", "1")
    assert code == 2 and "raise --num-blocks to at least" in err
    # kiln run has no --max-model-len (its longest sequence is the prompt + --max-tokens): the message names none
    assert "max-model-len" not in err and "max_model_len" not in err


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone


def test_help_texts_say_what_the_flags_take(capsys):
    for cmd in (["run"], ["serve"], ["bench", "throughput"]):
        text = _help(capsys, *cmd)
        assert "a .gguf file or a `kiln quantize` output" in text, cmd
        assert "also gguf: keep its Q4_0 / Q4_1 / Q8_0 linears quantized" in text and "none: dequantize all" in text
    for cmd in (["bench", "quality"], ["bench", "perplexity"]):
        assert "or a .gguf file" in _help(capsys, *cmd) and "not a `kiln quantize` output" in _help(capsys, *cmd)
    assert "(default bench/results, relative to the working directory" in _help(capsys, "bench", "serve")
    assert "for a GGUF, its general.name metadata" in _help(capsys, "import")


def test_compile_without_cuda_or_the_interpreter_says_how_to_run_it(capsys, monkeypatch):
    import kiln.compile.driver as driver

    monkeypatch.setattr(driver, "kernels_usable", lambda: False)
    code, _, err = run_cli(capsys, "compile", "tiny-llama")
    assert code == 2 and "run it as `TRITON_INTERPRET=1 kiln compile ...`" in err


def test_chat_with_prompt_ids_is_refused_not_ignored(capsys):
    code, _, err = run_cli(capsys, "run", "--prompt-ids", "1,2", "--chat")
    assert code == 2 and "--chat wraps --prompt's text in the chat template; --prompt-ids is the prompt as given" in err


def test_quantize_gguf_without_gguf_weights_says_what_it_needs(capsys):
    code, _, err = run_cli(capsys, "run", "tiny-llama", "--quantize", "gguf", "--prompt", "hi")
    assert code == 2 and "keeps a GGUF file's quantized linears: it needs GGUF weights (--weights FILE.gguf)" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        # a misspelt required flag: argparse alone says "--prompt --prompt-ids is required"
        (["run", "tiny-llama", "--promt", "hi"], "run: error: unrecognized argument --promt: did you mean --prompt?"),
        (["bench", "throughput", "--num-reqests", "3"], "argument --num-reqests: did you mean --num-requests?"),
        (["serve", "--max-num-seqs", "4", "--frobnicate"], "--frobnicate: see `kiln serve --help` for its flags"),
    ],
)
def test_a_misspelt_flag_is_named_with_the_closest_one(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_flag_values_and_abbreviations_are_not_taken_for_flags(capsys):
    # a value after its flag, a value after "=", and argparse's unique prefix (--max-tok) all pass the check
    code, out, _ = run_cli(capsys, "run", "--stop=--x", "--prompt-ids", "1,2", "--max-tok", "2", "--temperature", "0",
                           "--json")
    assert code == 0 and '"token_ids"' in out


def test_a_value_with_a_space_after_a_several_value_flag_is_not_a_flag():
    # --served-model-name takes one or more values; argparse reads "--b c" (a space) as a value, and so does the check
    from kiln.cli.commands import build_parser
    from kiln.cli.unknown_flags import check_unknown_flags

    argv = ["serve", "tiny-llama", "--served-model-name", "a", "--b c"]
    check_unknown_flags(build_parser(), argv)  # no SystemExit
    assert build_parser().parse_args(argv).served_model_name == ["a", "--b c"]
