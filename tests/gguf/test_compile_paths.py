"""`kiln compile SPEC --weights FILE.gguf` says which tensors loading keeps as int4 / int8 and which it dequantizes,
in the load line's words, from the tensor types alone."""

from __future__ import annotations

import pytest
import torch

from kiln.gguf.config import open_gguf
from kiln.gguf.weights import gguf_paths, load_gguf_weights, paths_summary
from tests.support.gguf_helper import tiny_config, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-compile")
    path, spec = d / "tiny.Q4_1.gguf", d / "tiny.kiln"
    write_tiny_gguf(path)
    from kiln.cli import main

    assert main(["import", str(path), "-o", str(spec), "--name", "tiny-gguf"]) == 0
    return path, spec


@pytest.mark.parametrize("keep", [True, False])
def test_planned_paths_are_the_ones_loading_takes(tiny, keep):
    path, _ = tiny
    reader = open_gguf(path)
    loaded = load_gguf_weights(reader, path, tiny_config(), arch="llama", keep=keep).paths
    assert gguf_paths(reader, keep=keep, dtype=torch.float32) == loaded


def test_compile_reports_kept_and_dequantized_tensors(tiny, capsys):
    from kiln.cli import main

    path, spec = tiny
    assert main(["compile", str(spec), "--weights", str(path)]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith(f"kiln: {path.name}: "))
    kept = paths_summary(gguf_paths(open_gguf(path), keep=True, dtype=torch.float32))
    assert line == f"kiln: {path.name}: {kept}"
    assert "14 Q4_1 -> int4 g32 (kept)" in line  # 2 layers x q, k, v, o, gate, up, down


def test_compile_with_a_scheme_reports_dequantized_then_requantized(tiny, capsys):
    from kiln.cli import main

    path, spec = tiny
    assert main(["compile", str(spec), "--weights", str(path), "--quantize", "int8"]) == 0
    err = capsys.readouterr().err
    assert "Q4_1 -> float32 (dequantized)" in err and "then requantized by int8's scheme" in err
    assert "(kept)" not in err


def test_compile_with_weights_that_are_not_a_gguf_is_a_usage_error(tiny, tmp_path, capsys):
    from kiln.cli import main

    _, spec = tiny
    assert main(["compile", str(spec), "--weights", str(tmp_path)]) == 2
    assert "reports a .gguf's load paths only" in capsys.readouterr().err
