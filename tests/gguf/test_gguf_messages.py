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
