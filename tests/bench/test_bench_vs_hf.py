"""bench/serving_vs_hf.py on the tiniest setting: the shape of its JSON and the tokens each side generated
(never its timings), and the spec -> transformers config it builds the HF side from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.spec.loader import load_spec
from tests.support.bench_scripts import load_script

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mod = load_script("serving_vs_hf.py", mp)
    yield mod
    mp.undo()


def test_runs_both_sides_on_the_same_trace(bench, tmp_path, capsys):
    code = bench.main(["tiny-llama", "--num-requests", "3", "--input-len", "4:9", "--output-len", "2:6",
                       "--batch-size", "2", "--warmup", "1", "--device", "cpu", "--out-dir", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    files = list(tmp_path.glob("serving_vs_hf-tiny-llama-cpu-*.json"))
    assert len(files) == 1
    r = json.loads(files[0].read_text())
    assert r == json.loads(out)
    assert {"device", "torch", "triton", "cuda", "commit", "date", "transformers"} <= set(r)
    assert r["model"] == "tiny-llama" and r["dtype"] == "fp32" and r["device"].startswith("cpu")
    trace = r["trace"]
    assert trace["num_requests"] == 3 and trace["clipped"] == 0
    assert r["config"]["hf_batch_size"] == 2 and r["config"]["max_num_seqs"] == 2  # defaults to the batch size
    hf, kl = r["hf"], r["kiln"]
    # Both produce exactly the trace's output tokens; HF's static batches also decode padding past them.
    assert hf["output_tokens"] == kl["output_tokens"] == trace["output_tokens"] >= 3 * 2
    assert hf["generated_tokens"] >= hf["output_tokens"] and hf["batches"] == 2
    for side in (hf, kl):
        assert side["elapsed_s"] > 0 and side["output_tokens_per_s"] > 0 and side["requests_per_s"] > 0
    assert r["ratio"]["output_tokens_per_s"] > 0
    assert r["target"] == {"min_ratio": 3.0, "applies": False, "met": None}
    assert "hf: 3/3 requests done" in err
    assert r["status"] == "complete"


def test_hf_half_is_written_before_kiln_half_runs(bench, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kiln's half broke")

    monkeypatch.setattr(bench, "load_model", broken)  # the first thing kiln's half does
    with pytest.raises(RuntimeError, match="kiln's half broke"):
        bench.main(["tiny-llama", "--num-requests", "2", "--input-len", "4:6", "--output-len", "2:3",
                    "--batch-size", "2", "--warmup", "0", "--device", "cpu", "--out-dir", str(tmp_path)])
    [path] = tmp_path.glob("serving_vs_hf-tiny-llama-*.json")
    r = json.loads(path.read_text())
    assert r["status"].startswith("partial") and "kiln" in r["status"]
    assert r["hf"]["output_tokens"] == r["trace"]["output_tokens"] and "kiln" not in r and "ratio" not in r


def test_hf_config_mirrors_a_llama_spec(bench):
    hf = bench.hf_config(load_spec("llama-3.2-1b").model)
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
            hf.head_dim, hf.intermediate_size) == (128256, 2048, 16, 32, 8, 64, 8192)
    assert hf.tie_word_embeddings and hf.rms_norm_eps == 1e-5
    rope = hf.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000 and rope["factor"] == 32
    assert rope["original_max_position_embeddings"] == 8192


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-qwen2", "tiny-mistral"])
def test_other_families_are_refused(bench, spec):
    with pytest.raises(SystemExit, match="only llama-family specs"):
        bench.hf_config(load_spec(spec).model)
