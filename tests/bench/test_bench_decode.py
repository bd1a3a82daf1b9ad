"""bench/decode.py on CPU at tiny sizes (figures checked for shape, never speed), and its baseline model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kiln.build import load_model
from kiln.errors import KilnError
from kiln.spec.loader import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # for bench_meta and static_decode, as when run as a script
    spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "bench" / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("static_decode", None)


def test_static_decoder_computes_the_level1_graph(bench):
    from static_decode import StaticDecoder

    m = load_model("tiny-llama", device="cpu", dtype="fp32")
    dec = StaticDecoder(m.model, dict(m.gm.named_parameters()), 32)
    toks = torch.randint(0, m.model.vocab, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.gm(toks[None], torch.arange(20)[None])[0].float()
        got = [dec(toks[:12], torch.arange(12))]  # a prefill, then one token at a time from the cache
        got += [dec(toks[i : i + 1], torch.tensor([i])) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_baseline_refuses_a_non_llama_spec(bench):
    from static_decode import check_llama_family

    with pytest.raises(KilnError, match="llama-family"):
        check_llama_family(load_spec("gpt2").model)


def test_decode_bench_runs_end_to_end_on_cpu(bench, tmp_path):
    result = bench.main(["tiny-llama", "--prompt-lens", "5", "--new-tokens", "4", "--dtype", "fp32", "--device",
                         "cpu", "--copy-mib", "4", "--compile-mode", "none", "--out-dir", str(tmp_path)])
    [row] = result["rows"]
    assert row["kiln_tok_s"] > 0 and row["baseline_tok_s"] > 0 and row["spec"] == "tiny-llama"
    assert 0 < row["kiln_bandwidth_share"] and row["bytes_per_step"] > 0
    assert row["greedy_tokens_agree"] == 4  # fp32, same weights: the same greedy tokens
    assert row["weight_bytes"] > 0 and row["load_random_weights_s"] > 0 and row["write_same_bytes_s"] > 0
    assert row["ttft_first_s"] > 0 and row["ttft_second_s"] > 0 and row["ttft_first_over_second"] > 0
    # the same request again with async scheduling flipped (off by default on CPU, so on): the same tokens
    assert row["async_scheduling"] is False and row["kiln_tok_s_async_flipped"] > 0
    assert row["async_flipped_tokens_agree"] is True
    saved = json.loads(next(tmp_path.glob("decode-tiny-llama-*.json")).read_text())
    assert saved["rows"] == result["rows"] and saved["copy_bandwidth_gb_s"] > 0 and saved["torch"]
