"""codegen/quant_tiles.py: which kernel, tile and split-K a quantized linear gets (pure: no kernel runs here)."""

from __future__ import annotations

import itertools

import pytest

from kiln.codegen import quant_tiles
from kiln.codegen.quant_tiles import GEMV_MAX_M, QuantTile, choose_tile

H100 = {"sm_count": 132, "capability": (9, 0)}
LLAMA_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
            "lm_head": (128256, 2048)}  # fmt: skip


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 0), (8, 32)])
def test_every_choice_is_a_legal_launch_that_covers_k_without_empty_splits(bits, group):
    for m, n, k, sms in itertools.product((1, 3, 4, 5, 16, 33, 64, 300), (24, 576, 2048, 128256),
                                          (128, 576, 1536, 2048, 14336), (1, 8, 132)):  # fmt: skip
        if k % max(group, 32 if bits == 4 else 1):
            continue
        t = choose_tile(bits, group, m, n, k, sm_count=sms)
        assert t.kernel == ("quant_gemv" if m <= GEMV_MAX_M else "quant_gemm")
        assert all(_pow2(v) for v in (t.block_m, t.block_n, t.block_k))
        assert t.block_k >= (32 if bits == 4 or group else 16)
        if t.kernel == "quant_gemm":
            assert t.block_m >= 16 and t.block_n >= 16 and (m > 64 or t.block_m >= m)  # one M tile up to 64 rows
        k_split = t.k_split(k)
        assert k_split % t.block_k == 0 and t.split_k >= 1
        assert (t.split_k - 1) * k_split < k <= t.split_k * k_split, (m, n, k, sms, t)


def test_llama_1b_decode_needs_no_split_but_the_m16_gemm_on_small_n_does():
    for name, (n, k) in LLAMA_1B.items():
        t = choose_tile(4, 128, 1, n, k, **H100)
        assert t == QuantTile("quant_gemv", 1, 4, 2048), name  # >= 512 programs: every SM busy twice over
    o16 = choose_tile(4, 128, 16, *LLAMA_1B["o"], **H100)
    assert (o16.kernel, o16.block_m, o16.split_k) == ("quant_gemm", 16, 4)  # 32 output tiles -> 128 programs
    assert choose_tile(4, 128, 16, *LLAMA_1B["gate_up"], **H100).split_k == 1  # 256 tiles fill the SMs
    small = choose_tile(4, 128, 1, 576, 1536, **H100)  # SmolLM2's down projection: 144 tiles for 132 SMs
    assert small.split_k == 2 and small.block_k == 512


def test_measured_entries_win_over_the_base_table(monkeypatch):
    tuned = QuantTile("quant_gemv", 1, 8, 1024, 2, 8)
    monkeypatch.setitem(quant_tiles.MEASURED, ((9, 0), "quant_gemv", 4, 128, 1, 2048, 2048), tuned)
    assert choose_tile(4, 128, 1, 2048, 2048, **H100) == tuned
    assert choose_tile(4, 128, 1, 2048, 2048, sm_count=132, capability=(8, 0)) != tuned  # another GPU class
    assert choose_tile(4, 64, 1, 2048, 2048, **H100) != tuned  # another group


def test_a_forced_kernel_gets_that_familys_tile():
    assert choose_tile(8, 0, 17, 40, 100, sm_count=1, kernel="quant_gemv").kernel == "quant_gemv"
    t = choose_tile(8, 0, 1, 40, 100, sm_count=1, kernel="quant_gemm")
    assert (t.kernel, t.block_m, t.block_n, t.block_k) == ("quant_gemm", 16, 64, 128)


@pytest.mark.parametrize("n", [262144, 1_000_003])
def test_a_huge_n_keeps_the_gemv_grid_within_cudas_y_limit(n):
    """A 262k-vocabulary quantized lm_head at decode: 4-row blocks would need 65536 programs on grid axis 1."""
    for bits, group in ((4, 128), (8, 0)):
        for m in (1, 4):
            t = choose_tile(bits, group, m, n, 2048, sm_count=132, capability=(9, 0))
            assert t.kernel == "quant_gemv" and -(-n // t.block_n) <= 65535
    assert choose_tile(4, 128, 1, 4096, 2048, sm_count=132).block_n == 4  # ordinary shapes keep the base tile
