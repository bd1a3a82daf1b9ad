"""bench/decode.py on CPU at tiny sizes (figures checked for shape, never speed), and its baseline model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kiln.build import load_model
from kiln.errors import KilnError
from kiln.spec.loader import load_spec
from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("decode.py", monkeypatch)
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


def test_a_failing_row_is_recorded_and_every_row_is_saved_as_it_ends(bench, tmp_path, monkeypatch):
    real, calls = bench.kiln_decode, []

    def flaky(m, prompt, new_tokens):  # row 1 measures, row 2 raises, row 3 is "killed" (not an Exception)
        calls.append(len(prompt))
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if len(calls) == 3:
            saved = json.loads(next(tmp_path.glob("decode-tiny-llama-*.json")).read_text())
            assert [r["prompt_len"] for r in saved["rows"]] == [5, 6]  # on disk before row 3 ends
            raise KeyboardInterrupt  # as a timeout's kill would: nothing after this point runs
        return real(m, prompt, new_tokens)

    monkeypatch.setattr(bench, "kiln_decode", flaky)
    argv = ["tiny-llama", "--prompt-lens", "5", "6", "7", "--new-tokens", "3", "--dtype", "fp32", "--device", "cpu",
            "--copy-mib", "4", "--compile-mode", "none", "--out-dir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    saved = json.loads(next(tmp_path.glob("decode-tiny-llama-*.json")).read_text())
    good, bad = saved["rows"]
    assert good["prompt_len"] == 5 and good["kiln_tok_s"] > 0 and "error" not in good
    assert bad == {"spec": "tiny-llama", "prompt_len": 6,
                   "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert saved["errors"] == ["tiny-llama prompt 6: " + bad["error"]]


def test_the_script_exits_1_when_a_row_failed(bench, monkeypatch):
    monkeypatch.setattr(bench, "main", lambda argv=None: {"errors": ["tiny-llama prompt 6: boom"]})
    assert bench.cli([]) == 1
    monkeypatch.setattr(bench, "main", lambda argv=None: {"errors": []})
    assert bench.cli([]) == 0


def test_a_prompt_longer_than_the_context_is_that_rows_error_and_the_next_row_runs(bench, tmp_path, monkeypatch):
    # tiny-llama's context is 256: 254 + 3 new tokens do not fit, 5 + 3 do; the row that cannot run loads nothing
    loads = []
    real_load = bench.load_model
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    argv = ["tiny-llama", "--prompt-lens", "254", "5", "--new-tokens", "3", "--dtype", "fp32", "--device", "cpu",
            "--copy-mib", "4", "--compile-mode", "none", "--out-dir", str(tmp_path)]
    assert bench.cli(argv) == 1
    saved = json.loads(next(tmp_path.glob("decode-tiny-llama-*.json")).read_text())
    bad, good = saved["rows"]
    assert bad == {"spec": "tiny-llama", "prompt_len": 254,
                   "error": "ValueError: prompt 254 + 3 new tokens exceeds tiny-llama's context 256"}
    assert saved["errors"] == ["tiny-llama prompt 254: " + bad["error"]]
    assert good["prompt_len"] == 5 and good["kiln_tok_s"] > 0 and "error" not in good
    assert len(loads) == 1
