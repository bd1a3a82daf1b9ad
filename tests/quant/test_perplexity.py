"""`kiln bench perplexity` on a tiny GGUF: finite figures, the kept Q4_1 equal to its dequantized fp32 model, JSON."""

from __future__ import annotations

import json
import math

import pytest

from kiln.cli.perplexity import run_perplexity, window_nll
from kiln.errors import KilnError
from tests.support.gguf_helper import tiny_gguf_and_text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf_and_text(tmp_path_factory.mktemp("ppl"))


def test_variants_and_the_kept_gguf_equal_to_fp32(tiny):
    path, text = tiny
    r = run_perplexity(None, path, text, variants=["fp32", "gguf", "int8"], window=64)
    v = r["variants"]
    assert r["tokens"] > 64 and v["fp32"]["scored_tokens"] == r["tokens"] - math.ceil(r["tokens"] / 64)
    assert all(math.isfinite(x["perplexity"]) and x["perplexity"] > 1 for x in v.values())
    assert v["gguf"]["perplexity"] == pytest.approx(v["fp32"]["perplexity"], rel=1e-5)
    assert v["fp32"]["vs_fp32"] == 0


def test_window_nll_counts_every_token_but_the_first_of_each_window(tiny):
    from kiln.build import load_model

    path, _ = tiny
    gm = load_model(None, path, device="cpu", quantize="none").gm
    _, n = window_nll(gm, list(range(10, 60)), 16)
    assert n == 50 - 4  # windows of 16, 16, 16, 2


def test_cli_writes_json(tiny, tmp_path, capsys):
    from kiln.cli import main

    path, text = tiny
    out = tmp_path / "r.json"
    assert main(["bench", "perplexity", "--weights", str(path), "--text", str(text), "--variants", "fp32",
                 "--window", "32", "-o", str(out)]) == 0
    assert "fp32" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["variants"]["fp32"]["perplexity"] > 1
    assert {"device", "torch", "triton", "commit", "date"} <= set(result)  # where and with what it was measured


def test_bad_requests_are_kiln_errors(tiny, tmp_path):
    path, text = tiny
    with pytest.raises(KilnError, match="no such file"):
        run_perplexity(None, path, tmp_path / "missing.txt", variants=["fp32"])
    with pytest.raises(KilnError, match="not a .gguf"):
        run_perplexity("tiny-llama", None, text, variants=["gguf"])
