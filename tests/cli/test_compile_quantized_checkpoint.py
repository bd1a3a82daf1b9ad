"""`kiln compile` of a `kiln quantize` output compiles it as `kiln run` runs it: the stored scheme and dtype (the
graph, weight size and kernels of `kiln compile SOURCE --quantize SCHEME`), and a --quantize or --dtype that differs
is refused with `kiln run`'s message."""

from __future__ import annotations

import pytest

from kiln.cli.commands import main


def _run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _summary(err: str) -> str:
    """The report line, less the kernel cache counts (which differ between a first and a second compile)."""
    line = next(x for x in err.splitlines() if x.startswith("kiln: tiny-llama: "))
    return line[: line.index(" kernels (")]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int4-g32"
    assert main(["quantize", "tiny-llama", "--quantize", "int4-g32", "-o", str(out), "--device", "cpu"]) == 0
    return out


def test_a_quantized_checkpoint_compiles_its_stored_scheme(quantized, tmp_path, capsys):
    rc, want = _run(capsys, "compile", "tiny-llama", "--quantize", "int4-g32", "--emit", str(tmp_path / "want"))
    assert rc == 0, want
    rc, got = _run(capsys, "compile", str(quantized), "--emit", str(tmp_path / "got"))
    assert rc == 0, got
    assert "passes: gqa_fusion, quantize (int4-rtn-g32)," in _summary(got)
    assert _summary(got) == _summary(want)
    graphs = sorted(p.name for p in (tmp_path / "want" / "graphs").iterdir())
    assert graphs == sorted(p.name for p in (tmp_path / "got" / "graphs").iterdir())
    for name in graphs:
        assert (tmp_path / "got" / "graphs" / name).read_text() == (tmp_path / "want" / "graphs" / name).read_text()
    rc, with_spec = _run(capsys, "compile", "tiny-llama", "--weights", str(quantized))  # the spec given beside it
    assert rc == 0 and _summary(with_spec) == _summary(want)


def test_another_scheme_or_dtype_is_refused_as_kiln_run_refuses_it(quantized, capsys):
    rc, err = _run(capsys, "compile", str(quantized), "--quantize", "int8")
    assert rc == 2 and "cannot be quantized again" in err
    run_rc, run_err = _run(capsys, "run", str(quantized), "--quantize", "int8", "--prompt", "hi", "--device", "cpu")
    assert run_rc == 2 and err.strip().splitlines()[-1] == run_err.strip().splitlines()[-1]
    rc, err = _run(capsys, "compile", str(quantized), "--dtype", "bf16")
    assert rc == 2 and "stored in fp32, and its dtype is fixed when it is written" in err
    rc, err = _run(capsys, "compile", str(quantized), "--quantize", "int4-g32")  # the stored scheme: accepted
    assert rc == 0 and "quantize (int4-rtn-g32)" in _summary(err)


def test_a_gptq_checkpoints_note_says_it_was_calibrated_when_written(tmp_path, capsys):
    out = tmp_path / "gptq"
    assert main(["quantize", "tiny-llama", "--quantize", "int4-gptq-g32", "-o", str(out), "--device", "cpu"]) == 0
    rc, err = _run(capsys, "compile", str(out))
    assert rc == 0 and f"int4-gptq-g32: GPTQ calibrated when `kiln quantize` wrote {out}" in err
    assert "quantize (int4-gptq-g32)" in _summary(err)
