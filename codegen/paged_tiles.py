"""What the paged attention kernels launch with when nothing is pinned: the split-KV decode's tile and split
count, the paged prefill's tile, and tuning the decode tile (codegen/paged.py launches; bench/ tunes).

Decode tiles are TileConfigs whose block_m is the program's query rows (the kv head's group of query heads,
padded to tl.dot's 16), block_n the keys per step, and warps / stages the launch options. On CUDA a tile
tuned on this GPU (tune_decode, or flash_tiling for the prefill's flash tile) is read from the tuning cache,
never timed here: these run inside serving steps. The choice is memoized per problem, so a step (and a CUDA
graph captured from it) pays no lookup after the first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kiln import env
from kiln.codegen import autotune
from kiln.codegen._host import cdiv, next_power_of_2
from kiln.codegen.tiles import TileConfig, candidate_tiles, default_tile, shared_memory_estimate, shared_memory_limit

MAX_SPLITS = 32
MIN_SPLIT_KEYS = 128  # fewer keys per split than this and the merge costs more than the parallelism gains
# (block_n, warps, stages): decode is bound by K/V bandwidth, so the candidates vary the bytes in flight.
_DECODE_CANDIDATES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 4, 2), (128, 4, 3),
                      (128, 8, 3), (64, 8, 3))  # fmt: skip
_DECODE_INTERPRETER_CANDIDATES = ((32, 4, 1), (16, 4, 1), (64, 4, 1))


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(num_seqs: int, kv_heads: int, span: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence for split-KV decode over `span` visible keys (the batch's max_context_len, or the
    window), by FlashAttention-2's wave heuristic: programs are (sequence, kv head, split), two resident per SM.
    A batch that fills most of a wave alone takes 1; otherwise, among the useful split counts (each split at
    least MIN_SPLIT_KEYS keys, at most MAX_SPLITS, and each count changing the tiles per split), the smallest
    whose wave efficiency (programs / slots of the waves they take) is within 85% of the best."""
    sms = 1
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    slots, base = 2 * sms, max(1, num_seqs * kv_heads)
    if base >= 0.8 * slots:
        return 1
    tiles = cdiv(max(span, 1), block_n)
    useful = max(1, min(MAX_SPLITS, cdiv(span, max(MIN_SPLIT_KEYS, block_n))))
    counts = [s for s in range(1, useful + 1) if s == 1 or cdiv(tiles, s) != cdiv(tiles, s - 1)]
    efficiency = {s: base * s / (cdiv(base * s, slots) * slots) for s in counts}
    best = max(efficiency.values())
    return next(s for s in counts if efficiency[s] >= 0.85 * best)


def decode_splits(num_seqs: int, kv_heads: int, max_context_len: int, window: int, block_n: int,
                  device: torch.device, num_splits: int | None = None) -> int:  # fmt: skip
    """The split count the decode launches: choose_splits over the visible span (the batch's max_context_len,
    or the window), or the asked num_splits, less any split that would lie wholly past it."""
    span = max(1, min(max_context_len, window) if window > 0 else max_context_len)
    if num_splits is None:
        num_splits = choose_splits(num_seqs, kv_heads, span, block_n, device)
    return cdiv(span, cdiv(cdiv(span, num_splits), block_n) * block_n)


def decode_candidates(head_dim: int, group: int, dtype: torch.dtype, capability: tuple[int, int] | None
                      ) -> list[TileConfig]:  # fmt: skip
    """The decode tiles worth timing, the default first; those whose K/V buffers overflow shared memory are out."""
    rows = max(16, next_power_of_2(group))
    default = default_decode_tile(head_dim, group, capability)
    out = [default]
    for block_n, warps, stages in _DECODE_CANDIDATES if capability is not None else _DECODE_INTERPRETER_CANDIDATES:
        tile = TileConfig(rows, block_n, warps, stages)
        fits = capability is None or shared_memory_estimate(tile, head_dim, dtype) <= shared_memory_limit(capability)
        if fits and tile not in out:
            out.append(tile)
    return out


def default_decode_tile(head_dim: int, group: int, capability: tuple[int, int] | None) -> TileConfig:
    """64 keys per step on a GPU (32 above head dim 128, and in the interpreter), 4 warps, 2 stages."""
    block_n = 64 if capability is not None and head_dim <= 128 else 32
    return TileConfig(max(16, next_power_of_2(group)), block_n, 4, 2 if capability is not None else 1)


def _decode_problem(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int) -> dict[str, Any]:
    return {"dtype": _dtype_name(dtype), "kv_dtype": _dtype_name(kv_dtype), "head_dim": head_dim, "group": group}


@functools.cache
def decode_tile(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int
                ) -> TileConfig:  # fmt: skip
    """The decode's tile: on CUDA the one tune_decode found on this GPU, if any; else the default."""
    capability = _capability(device)
    if capability is not None and env.autotune():
        candidates = decode_candidates(head_dim, group, dtype, capability)
        problem = _decode_problem(dtype, kv_dtype, head_dim, group)
        tuned = autotune.lookup("paged_decode", device, problem, candidates)
        if tuned is not None:
            return tuned
    return default_decode_tile(head_dim, group, capability)


def tune_decode(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int,
                make_call: Callable[[TileConfig], Callable[[], Any]]) -> TileConfig:  # fmt: skip
    """Time the decode candidates with make_call(tile) (a launch of paged_attention_decode with that tile on
    representative inputs) and cache the fastest for decode_tile; returns it (or the cached one, untimed)."""
    candidates = decode_candidates(head_dim, group, dtype, _capability(device))
    best = autotune.tune("paged_decode", device, _decode_problem(dtype, kv_dtype, head_dim, group), candidates,
                         make_call)  # fmt: skip
    decode_tile.cache_clear()  # a later decode in this process sees the new result
    return best


def flash_problem(dtype: torch.dtype, head_dim: int, causal: bool, has_window: bool,
                  capability: tuple[int, int] | None) -> dict[str, Any]:
    """The flash_attn tuning problem: what the best tile depends on, including whether the kernel loads through
    TMA descriptors (KILN_FLASH_TMA=1 on sm90+ with a power-of-two head_dim; otherwise it falls back to pointer
    loads, the paged prefill's kind, and shares its tile)."""
    tma = (env.flash_tma() and capability is not None and capability >= (9, 0)
           and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)
    return {"dtype": _dtype_name(dtype), "head_dim": head_dim, "causal": bool(causal), "window": bool(has_window),
            "tma": tma}


@functools.cache
def prefill_tile(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool, has_window: bool) -> TileConfig:
    """The paged prefill's tile: on CUDA the flash kernel's tuned tile for this problem if a compile or benchmark
    tuned it on this GPU (the kernels share their loop), else the default table's."""
    capability = _capability(device)
    if capability is not None and env.autotune():
        # the paged prefill loads through pointers: the tile flash tuned without TMA fits it
        problem = {**flash_problem(dtype, head_dim, causal, has_window, capability), "tma": False}
        tuned = autotune.lookup("flash_attn", device, problem, candidate_tiles(head_dim, dtype, capability))
        if tuned is not None:
            return tuned
    return default_tile(head_dim, dtype, capability)
