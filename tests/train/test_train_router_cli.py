"""`kiln train-router` end to end on a tiny random-weight model, and the routers file it writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kiln.build import load_model
from kiln.cli.commands import main
from kiln.errors import KilnError, WeightError
from kiln.ir.frontend import build_graph
from kiln.model_config import ModConfig
from kiln.train.router_files import attach_routers, load_routers, save_routers

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"


def test_train_router_writes_routers_that_rebuild_the_routed_model(tmp_path, capsys):
    out = tmp_path / "routers.safetensors"
    rc = main(["train-router", "tiny-llama", "--text", str(DATA / "shakespeare-calibration.txt"), "--capacity",
               "0.5", "--steps", "2", "--seq-len", "32", "--eval-text", str(DATA / "shakespeare-coriolanus.txt"),
               "--eval-tokens", "200", "-o", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "dense: perplexity" in printed and "routed: perplexity" in printed
    route, tensors = load_routers(out)
    assert route == ModConfig(0.5, 2, "threshold", 0)
    assert sorted(tensors) == ["layers.1.router.bias", "layers.1.router.threshold", "layers.1.router.weight"]
    m = load_model("tiny-llama", None, dtype="fp32", device="cpu")
    cfg, gm = attach_routers(m.model, m.gm, out)
    assert cfg.route == route
    want = build_graph(cfg, {**{n: p.detach() for n, p in m.gm.named_parameters()}, **tensors})
    tokens = torch.randint(0, cfg.vocab, (1, 11))
    pos = torch.arange(11)[None]
    torch.testing.assert_close(gm(tokens, pos), want(tokens, pos), rtol=0, atol=0)


def test_bad_capacity_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-router", "tiny-llama", "--text", str(DATA / "shakespeare-calibration.txt"), "--capacity", "1.5",
              "-o", str(tmp_path / "r.safetensors")])
    assert e.value.code == 2
    assert "0 < capacity <= 1" in capsys.readouterr().err


def test_routers_of_another_model_are_refused(tmp_path):
    m = load_model("tiny-llama", None, dtype="fp32", device="cpu")
    other = dataclasses.replace(m.model, dim=32, route=ModConfig(0.5))
    path = save_routers(tmp_path / "r.safetensors", other, {"layers.1.router.weight": torch.zeros(1, 32),
                                                             "layers.1.router.bias": torch.ones(1),
                                                             "layers.1.router.threshold": torch.zeros(1)})
    with pytest.raises(WeightError, match="does not fit tiny-llama"):
        attach_routers(m.model, m.gm, path)
    with pytest.raises(KilnError, match="no such file"):
        attach_routers(m.model, m.gm, tmp_path / "missing.safetensors")
