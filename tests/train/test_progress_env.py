"""Router training and training from scratch show their progress bars unless TQDM_DISABLE says not to (the
caller's explicit `progress` wins either way)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kiln import env
from kiln.ir.frontend import random_weights
from kiln.spec.loader import load_spec
from kiln.train.routers import RouterTraining, distil
from kiln.train.scratch import ScratchTraining, train_from_scratch

TEXT = (Path(__file__).resolve().parents[2] / "bench" / "data" / "shakespeare-calibration.txt").read_bytes()[:3000]
DENSE = dataclasses.replace(load_spec("tiny-llama").model, layers=2)
IDS = list(TEXT)


@pytest.mark.parametrize(("value", "shown"), [(None, True), ("1", False), ("true", False), ("0", True), ("", True)])
def test_progress_bars_follow_tqdm_disable(monkeypatch, value, shown):
    if value is None:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TQDM_DISABLE", value)
    assert env.progress_bars() is shown


@pytest.mark.parametrize("disabled", [True, False])
def test_distil_and_training_honour_tqdm_disable(monkeypatch, capsys, disabled):
    if disabled:
        monkeypatch.setenv("TQDM_DISABLE", "1")
    else:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=0.5, steps=1, batch=1, seq_len=16))
    train_from_scratch(DENSE, IDS, ScratchTraining(steps=1, batch=1, seq_len=16))
    err = capsys.readouterr().err
    for bar in ("kiln: routers c=0.5", "kiln: train tiny-llama dense"):
        assert (bar in err) is not disabled, err
    distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=0.5, steps=1, batch=1, seq_len=16),
           progress=disabled)  # an explicit choice wins over the variable
    assert ("kiln: routers c=0.5" in capsys.readouterr().err) is disabled
