"""compile_step (compiler/compile_step.py): the runtime's step model, with and without generated kernels.

Three steps on tiny-llama and tiny-mistral (window 8, shorter than the contexts) over a shared paged cache
(block size 4, shuffled blocks): prefixes, then a mixed step (prefill, chunk after a cached prefix, decode: the
prefill kernel), then a decode-only step (the split-KV decode kernels). Kernels run interpreted without CUDA.
"""

import pytest
import torch

from kiln.compile.step import CompiledStep, allocate_kv_cache, compile_step
from kiln.errors import KilnError
from kiln.ir.frontend import build_graph
from kiln.spec.loader import load_spec
from kiln.step import KVCache
from tests.support.paged_helper import shuffled_block_tables, step_batch

LENS = [6, 9, 11]
STEPS = [
    [None, (0, 4), (0, 9)],  # prefixes of sequences 1 and 2
    [(0, 6), (4, 7), (9, 10)],  # prefill, chunk after a cached prefix, decode
    [None, (7, 8), (10, 11)],  # decodes only
]
BLOCK = 4


def _steps(seqs, tables):
    for chunks in STEPS:
        live = [i for i, c in enumerate(chunks) if c is not None]
        yield (
            live,
            [chunks[i][1] for i in live],
            step_batch([seqs[i] for i in live], [chunks[i] for i in live], [tables[i] for i in live], BLOCK),
        )


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mistral"])
def spec(request):
    cfg = load_spec(request.param).model
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in LENS]
    ref = build_graph(cfg, seed=2)
    with torch.no_grad():
        full = [ref(torch.tensor(s)[None], torch.arange(len(s))[None])[0] for s in seqs]
    return cfg, seqs, full


def test_kernels_match_reference_ops_and_level1(spec):
    cfg, seqs, full = spec
    with_kernels = compile_step(build_graph(cfg, seed=2), cfg, use_kernels=True)
    without = compile_step(build_graph(cfg, seed=2), cfg, use_kernels=False)
    assert with_kernels.use_kernels and not without.use_kernels
    tables, num_blocks = shuffled_block_tables(LENS, BLOCK, seed=9)
    cache_k = allocate_kv_cache(with_kernels, num_blocks, BLOCK)
    cache_r = allocate_kv_cache(without, num_blocks, BLOCK)
    for live, ends, batch in _steps(seqs, tables):
        got = with_kernels(batch, cache_k)
        ref = without(batch, cache_r)
        assert got.dtype == torch.float32 and got.shape == (len(live), cfg.vocab)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(cache_k.data, cache_r.data, rtol=1e-4, atol=1e-5)
        want = torch.stack([full[i][e - 1] for i, e in zip(live, ends, strict=True)])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def test_step_model_contract_and_cache_checks():
    cfg = load_spec("tiny-llama").model
    model = compile_step(build_graph(cfg, seed=2), cfg, use_kernels=False)
    assert isinstance(model, CompiledStep)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab) == (2, 2, 16, cfg.vocab)
    assert model.dtype == model.kv_dtype == torch.float32 and model.device == torch.device("cpu")
    assert model.passes == ["gqa_fusion", "rope_fusion", "kv_cache", "norm_fusion", "flash_tiling"]
    cache = allocate_kv_cache(model, num_blocks=5, block_size=8)
    assert cache.data.shape == (2, 2, 5, 8, 2, 16) and not cache.data.any() and cache.scales is None
    batch = step_batch([[1, 2, 3]], [(0, 3)], [[4]], 8)
    with pytest.raises(KilnError, match="allocate it with kiln.compile.step.allocate_kv_cache"):
        model(batch, cache.data.double())
    with pytest.raises(KilnError, match="kv_cache has shape"):
        model(batch, cache.data[:1])
    with pytest.raises(KilnError, match="and no scales"):
        model(batch, KVCache(cache.data, torch.zeros(cache.data.shape[:-1])))
    assert model(batch, cache.data).shape == (1, cfg.vocab)  # a bare tensor is a float cache


def test_use_kernels_true_without_cuda_or_the_interpreter_is_refused_at_compile(monkeypatch):
    """Not Triton's "0 active drivers" at the first step: a KilnError naming use_kernels, before any pass runs."""
    from kiln import env
    from kiln.build import load_model
    from kiln.compile.driver import compile_model
    from kiln.compile.step import compile_step
    from kiln.errors import KilnError

    m = load_model("tiny-llama", device="cpu", seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(env, "triton_interpret", lambda: False)
    for compile_fn in (lambda: compile_step(m.gm, m.model, m.compile, use_kernels=True),
                       lambda: compile_model(m.gm, m.compile, use_kernels=True)):
        with pytest.raises(KilnError, match=r"use_kernels=True needs CUDA or Triton's CPU interpreter"):
            compile_fn()
    assert compile_step(m.gm, m.model, m.compile).use_kernels is False  # the default picks reference ops there
