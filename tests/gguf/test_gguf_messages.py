"""GGUF path errors name the problem without a flag the command may not have (`kiln import FILE.gguf` has no
--weights): a damaged file, a directory whose name ends in .gguf, a missing file."""

from __future__ import annotations

from kiln.cli.commands import main


def _import(capsys, path) -> tuple[int, str]:
    rc = main(["import", str(path)])
    return rc, capsys.readouterr().err


def test_import_errors_say_what_the_path_is(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    rc, err = _import(capsys, bad)
    assert rc == 2 and "not a GGUF file" in err and "--weights" not in err
    d = tmp_path / "dir.gguf"
    d.mkdir()
    rc, err = _import(capsys, d)
    assert rc == 2 and "is a directory, not a GGUF file" in err and "--weights" not in err
    rc, err = _import(capsys, tmp_path / "missing.gguf")
    assert rc == 2 and "--weights" not in err


def test_a_spec_that_differs_from_the_gguf_or_the_quantized_checkpoint_is_refused(tmp_path, capsys):
    import pytest

    from kiln.build import load_model
    from kiln.errors import KilnError
    from tests.support.gguf_helper import write_tiny_gguf

    path, spec = tmp_path / "tiny.gguf", tmp_path / "tiny.kiln"
    write_tiny_gguf(path)
    assert main(["import", str(path), "-o", str(spec), "--name", "tiny-gguf"]) == 0
    load_model(spec, path, device="cpu")  # its own spec matches
    text = spec.read_text()
    assert "eps = 1e-05" in text, text
    spec.write_text(text.replace("eps = 1e-05", "eps = 0.1"))
    with pytest.raises(KilnError, match="norm eps: 0.1 in the spec, 1e-05 in the checkpoint"):
        load_model(spec, path, device="cpu")
    q = tmp_path / "q"
    spec.write_text(text)
    assert main(["quantize", str(spec), "--weights", str(path), "--quantize", "int8", "-o", str(q),
                 "--device", "cpu"]) == 0
    load_model(spec, q, device="cpu")
    spec.write_text(text.replace("eps = 1e-05", "eps = 0.1"))
    with pytest.raises(KilnError, match="norm eps: 0.1 in the spec, 1e-05 in the checkpoint"):
        load_model(spec, q, device="cpu")
