"""`kiln bench perplexity` variants kv-auto / kv-int8: the cached step model, prefilled in chunks over the cache.

kv-auto (an fp32 cache) scores what the uncached fp32 graph scores; kv-int8 differs from it, but only a little."""

from __future__ import annotations

import pytest

from kiln.cli.perplexity import run_perplexity, step_window_nll, window_nll
from tests.support.gguf_helper import tiny_gguf_and_text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf_and_text(tmp_path_factory.mktemp("ppl-kv"))


def _step(path, kv: str):
    from kiln.build import load_model
    from kiln.compile.step import compile_step

    m = load_model(None, path, device="cpu", quantize="none")
    ids = list(range(10, 60))
    want = window_nll(m.gm, ids, 24)
    return compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False, kv_cache_dtype=kv), ids, want


@pytest.mark.parametrize("chunk", [5, 24])
def test_fp32_cache_in_chunks_equals_the_uncached_graph(tiny, chunk):
    step, ids, (want, n_want) = _step(tiny[0], "auto")
    got, n = step_window_nll(step, ids, 24, chunk=chunk)
    assert n == n_want == 50 - 3  # windows of 24, 24, 2
    assert got == pytest.approx(want, rel=1e-5)


def test_int8_cache_moves_the_figure_a_little(tiny):
    step, ids, (want, _) = _step(tiny[0], "int8")
    got, _ = step_window_nll(step, ids, 24, chunk=8)
    assert got != want and got == pytest.approx(want, rel=0.05)


def test_run_perplexity_reports_the_kv_variants(tiny):
    path, text = tiny
    v = run_perplexity(None, path, text, variants=["fp32", "kv-auto", "kv-int8"], window=64, device="cpu")["variants"]
    assert v["kv-auto"]["perplexity"] == pytest.approx(v["fp32"]["perplexity"], rel=1e-5)
    assert v["kv-int8"]["scored_tokens"] == v["fp32"]["scored_tokens"]
    assert abs(v["kv-int8"]["vs_fp32"]) < 0.05
