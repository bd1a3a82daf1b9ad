"""How many splits the split-KV decode launches: from the batch's sequence count and context bound, the kv
heads and the GPU's SM count (an H100's 132 SMs are simulated here)."""

from __future__ import annotations

import pytest
import torch

import kiln.codegen.paged_tiles as paged

H100 = torch.device("cuda", 0)


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(paged, "_sm_count", lambda index: 132)


def _programs(num_seqs, kv_heads, splits):
    return num_seqs * kv_heads * splits


def test_a_batch_that_fills_the_gpu_is_not_split(h100):
    for batch in (64, 256):
        for ctx in (512, 4096, 32768):
            assert paged.choose_splits(batch, 8, ctx, 64, H100) == 1


def test_small_batches_split_long_contexts_to_fill_the_gpu(h100):
    slots = 2 * 132
    for batch, ctx in ((1, 4096), (1, 32768), (16, 4096), (4, 8192)):
        s = paged.choose_splits(batch, 8, ctx, 64, H100)
        assert s > 1 and ctx / s >= paged.MIN_SPLIT_KEYS and s <= paged.MAX_SPLITS
        waves = _programs(batch, 8, s) / slots
        assert waves / -(-waves // 1) >= 0.8  # the last wave is mostly full
    # More keys never mean fewer splits for one sequence, and a short context is split less than a long one.
    assert paged.choose_splits(1, 8, 512, 64, H100) < paged.choose_splits(1, 8, 32768, 64, H100)
    assert paged.choose_splits(1, 8, 100, 64, H100) == 1  # one tile of keys: nothing to split


def test_cpu_and_window_bound_the_span(h100):
    assert paged.choose_splits(1, 8, 32768, 32, torch.device("cpu")) == 1  # the interpreter: one program set
    # A window bounds the keys a split can take, whatever the context.
    windowed = paged.decode_splits(1, 8, 32768, 256, 64, H100)
    assert windowed == paged.decode_splits(1, 8, 256, 0, 64, H100) <= 2
    assert paged.decode_splits(2, 8, 4096, 0, 64, H100, num_splits=7) == 7  # asked for: as asked
    assert paged.decode_splits(2, 8, 100, 0, 64, H100, num_splits=7) == 2  # no split wholly past the keys
