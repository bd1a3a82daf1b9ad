"""`kiln train-router` refuses bad inputs up front with one clear line (before the model loads, and never after the
routers file is written), and routers files are attached only to the model they were trained for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.cli.commands import main
from kiln.errors import KilnError
from kiln.model_config import ModConfig
from kiln.train.router_files import attach_routers, save_routers
from kiln.train.routers import RouterTraining

TEXT = "the other one in the north, then another one over the river. " * 12


def _run(capsys, tmp_path, *argv, text: str | None = None, spec: str | None = "tiny-llama") -> tuple[int, str, bool]:
    """(exit code, stderr, whether the routers file exists) of train-router on `spec`."""
    t = tmp_path / "train.txt"
    t.write_text(TEXT)
    out = tmp_path / "r.safetensors"
    args = ["train-router", *([spec] if spec else []), "--text", text or str(t), "--capacity", "0.5", "-o", str(out),
            *argv]
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bug in kiln" not in err
    return rc, err, out.exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["--every", "3"], "--every 3: routes layers"),
    (["--seq-len", "0"], "--seq-len 0: give 2 to"),
    (["--seq-len", "-5"], "--seq-len -5: give 2 to"),
    (["--seq-len", "100000"], "--seq-len 100000: give 2 to"),
    (["--batch", "0"], "argument --batch: must be at least 1"),
    (["--eval-tokens", "0"], "argument --eval-tokens: must be at least 2"),
    (["--decide", "predictor", "--hidden", "0"], "argument --hidden: must be at least 1"),
    (["--lr", "-1"], "argument --lr: must be a positive number"),
    (["--steps", "-1"], "argument --steps: must be at least 0"),
    (["--calib-windows", "0"], "argument --calib-windows: must be at least 1"),
])
def test_bad_values_are_refused_before_training(capsys, tmp_path, argv, needle):
    rc, err, written = _run(capsys, tmp_path, *argv)
    assert rc == 2 and needle in err and not written


def test_bad_text_files_are_refused_before_training(capsys, tmp_path):
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"hello \xff\xfe world")
    rc, err, written = _run(capsys, tmp_path, text=str(bad))
    assert rc == 2 and f"--text {bad}: not UTF-8 text" in err and not written
    rc, err, written = _run(capsys, tmp_path, "--eval-text", str(bad))
    assert rc == 2 and f"--eval-text {bad}: not UTF-8 text" in err and not written
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc, err, written = _run(capsys, tmp_path, "--seq-len", "16", "--calib-windows", "1", "--eval-text", str(empty))
    assert rc == 2 and f"--eval-text {empty}: 0 token(s)" in err and not written


def test_the_default_window_is_capped_to_the_context(capsys, tmp_path, monkeypatch):
    from kiln.train import routers

    seen = {}

    def fake_distil(cfg, weights, ids, opts, progress=None):
        seen["seq_len"] = opts.seq_len
        raise KilnError("stop here")

    monkeypatch.setattr(routers, "distil", fake_distil)
    rc, err, _ = _run(capsys, tmp_path, "--weights", str(_tiny_gpt2(tmp_path)), spec=None)
    assert rc == 2 and "stop here" in err
    assert seen["seq_len"] == 64 and "--seq-len defaults to 256 tokens; using 64" in err


def _tiny_gpt2(tmp_path):
    from tests.support.hf_models import save_hf_model

    d = tmp_path / "gpt2"
    save_hf_model("gpt2", d)
    return d


def test_a_quantized_checkpoint_is_refused(capsys, tmp_path):
    q = tmp_path / "q"
    assert main(["quantize", "tiny-llama", "--quantize", "int8", "-o", str(q), "--device", "cpu"]) == 0
    rc, err, written = _run(capsys, tmp_path, "--weights", str(q), spec=None)
    assert rc == 2 and "is a `kiln quantize` output (int8); train-router needs full-precision weights" in err
    assert not written


def test_the_api_checks_its_settings_too():
    for bad in ({"batch": 0}, {"seq_len": 1}, {"steps": -1}, {"lr": -1.0}, {"calib_windows": 0},
                {"decide": "predictor", "hidden": 0}):
        with pytest.raises(KilnError, match="out of range"):
            RouterTraining(capacity=0.5, **bad).mod()


def test_routers_of_another_model_name_are_named_in_a_warning(tmp_path, caplog):
    from kiln.build import load_model

    m = load_model("tiny-llama", None, dtype="fp32", device="cpu")
    other = dataclasses.replace(m.model, name="tiny-other", route=ModConfig(0.5))
    path = save_routers(tmp_path / "r.safetensors", other, {
        "layers.1.router.weight": torch.zeros(1, m.model.dim), "layers.1.router.bias": torch.ones(1),
        "layers.1.router.threshold": torch.zeros(1)})
    with caplog.at_level("WARNING", logger="kiln.train"):
        routed, _ = attach_routers(m.model, m.gm, path)  # a folder's name is no proof of another model: a warning
    assert "trained for model 'tiny-other', not 'tiny-llama'" in caplog.text and routed.route is not None
    with pytest.raises(KilnError, match="routers file .*: no such file") as e:
        attach_routers(m.model, m.gm, tmp_path / "missing.safetensors")
    assert "--routers" not in str(e.value)


def test_no_empty_progress_bar_without_steps(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "")
    monkeypatch.delenv("TQDM_DISABLE")
    rc, err, written = _run(capsys, tmp_path, "--seq-len", "16", "--calib-windows", "2")
    assert rc == 0 and written
    assert "0it" not in err
