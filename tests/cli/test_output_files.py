"""Files and directories the CLI writes (kiln.cli.paths) are whole or absent, and get the mode a plain open() or
mkdir() would give them under the umask: tempfile and safetensors make private ones, which a server running as
another user could not read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.cli.paths import check_output_file, staged_dir, staged_file, write_file_atomic
from kiln.errors import UsageError


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_staged_directory_takes_the_umask_mode(tmp_path, umask):
    out = tmp_path / "quantized"
    with staged_dir("-o", out) as stage:
        save_file({"w": torch.zeros(2)}, str(stage / "model.safetensors"))  # safetensors writes 0600
        (stage / "sub").mkdir()
        (stage / "sub" / "spec.kiln").write_text("x")
    assert mode(out) == mode(out / "sub") == 0o777 & ~umask
    assert mode(out / "model.safetensors") == mode(out / "sub" / "spec.kiln") == 0o666 & ~umask


def test_a_staged_file_takes_the_umask_mode_and_is_whole_or_absent(tmp_path, umask):
    out = tmp_path / "routers.safetensors"
    with staged_file("-o", out) as stage:
        save_file({"w": torch.ones(3)}, str(stage))
        assert not out.exists()  # nothing at the real name until the writer is done
    assert mode(out) == 0o666 & ~umask
    with pytest.raises(RuntimeError), staged_file("-o", out) as stage:
        stage.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert out.stat().st_size > 4 and [p.name for p in tmp_path.iterdir()] == [out.name]  # old file kept, no temp


def test_write_file_atomic_takes_the_umask_mode(tmp_path, umask):
    write_file_atomic("-o", tmp_path / "m.kiln", "text")
    assert mode(tmp_path / "m.kiln") == 0o666 & ~umask


def test_a_directory_given_for_a_file_is_answered_with_the_commands_own_kind_of_file(tmp_path):
    with pytest.raises(UsageError, match=r"e\.g\. -o .*/routers\.safetensors$"):
        check_output_file("-o", str(tmp_path), example="routers.safetensors")
    with pytest.raises(UsageError, match=r"e\.g\. -o .*/model\.kiln$"):
        check_output_file("-o", str(tmp_path))
