"""Tile configurations for the flash-attention kernels: the heuristic table that picks one, and the short
candidate lists the autotuner (codegen/autotune.py) times.

The table is a starting point for the autotuner, not a measurement: the sizes follow the usual
flash-attention choices (128-row query tiles, 64-key tiles for head_dim <= 128, smaller tiles for 256 so
Q, K and V fit in shared memory with two pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import CodegenError


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int

    def validate(self) -> TileConfig:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise CodegenError(f"TileConfig.{name}={v} must be a power of two >= 16 (tl.dot needs 16)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise CodegenError(f"TileConfig.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise CodegenError(f"TileConfig.num_stages={self.num_stages} must be >= 1")
        return self

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# (max head_dim, block_m, block_n, num_warps, num_stages) for sm80+ with 2-byte inputs, first match wins.
_AMPERE_PLUS = (
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (256, 64, 32, 4, 2),
)
# Pre-Ampere parts have less shared memory and no async copies: halve the tiles, no deep pipelining.
_OLDER = (
    (64, 64, 64, 4, 2),
    (128, 64, 32, 4, 2),
    (256, 32, 32, 4, 1),
)
# The CPU interpreter runs every program and loop step serially with a fixed per-op cost, so fewer,
# larger steps are faster (T=100, D=128: 16x16 takes 7.9 s, 32x32 3.5 s, 64x64 1.7 s); 32 still gives
# short test sequences several blocks, so block skipping and the online rescale stay exercised.
INTERPRETER_TILE = TileConfig(32, 32, 4, 1)


def default_tile(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> TileConfig:
    """The heuristic tile for a head size, input dtype and CUDA compute capability (None: interpreter/CPU)."""
    if head_dim > 256:
        raise CodegenError(f"flash attention supports head_dim <= 256, got {head_dim}")
    if capability is None:
        return INTERPRETER_TILE
    table = _AMPERE_PLUS if capability >= (8, 0) else _OLDER
    _, block_m, block_n, warps, stages = next(row for row in table if head_dim <= row[0])
    if dtype == torch.float32:
        # 4-byte tiles take twice the shared memory and registers.
        block_n = max(16, block_n // 2)
        stages = min(stages, 2)
    tile = TileConfig(block_m, block_n, warps, stages)
    # Parts with 99 KiB per block (sm86 / sm89 / sm120) cannot hold the large fp32 tiles (compiled for sm86: 115 KB
    # at head_dim 128): fewer query rows, until sm90's measured bound fits. The 16-bit rows fit as they are.
    while (dtype == torch.float32 and tile.block_m > 16
           and shared_memory_estimate(tile, head_dim, dtype) > shared_memory_limit(capability)):
        tile = TileConfig(tile.block_m // 2, tile.block_n, tile.num_warps, tile.num_stages)
    return tile


# The autotuner's candidates for sm80+ (BLOCK_M 64/128, BLOCK_N 32/64/128, warps 4/8, stages 2-4), first the
# table's choice; those whose pipelined K/V buffers would not fit the device's shared memory are left out.
_CANDIDATES = (
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 4),
    (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4), (64, 32, 4, 4),
)  # fmt: skip
# The interpreter's: it pays per op, so these differ only in how many steps the loops take.
_INTERPRETER_CANDIDATES = ((32, 32, 4, 1), (16, 16, 4, 1), (64, 64, 4, 1), (64, 32, 4, 1))


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """Bytes of shared memory one program may use (the opt-in maximum per block)."""
    if (9, 0) <= capability < (12, 0):
        return 232448  # sm90 / sm100: 227 KiB
    if capability in ((8, 0), (8, 7)):
        return 166912  # A100 / Orin: 163 KiB
    if capability >= (8, 6):
        return 101376  # sm86 / sm89 / sm120: 99 KiB
    return 65536


def shared_memory_estimate(tile: TileConfig, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of shared memory the flash kernel takes on sm90 (Q, plus num_stages buffers of K and V), measured
    with triton 3.9's compiler for sm90 (sm80 takes less), so an upper bound for the filter."""
    block_d = max(16, 1 << max(head_dim - 1, 0).bit_length())
    size = torch.tensor([], dtype=dtype).element_size()
    return (tile.block_m * block_d + tile.num_stages * 2 * tile.block_n * block_d) * size


def candidate_tiles(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> list[TileConfig]:
    """The tiles worth timing for a head size, dtype and compute capability (None: the interpreter)."""
    default = default_tile(head_dim, dtype, capability)
    if capability is None:
        rows = _INTERPRETER_CANDIDATES
    elif capability < (8, 0):
        return [default]  # no async copies to pipeline: the table's choice
    else:
        rows = _CANDIDATES
    out = [default]
    for row in rows:
        tile = TileConfig(*row)
        fits = capability is None or shared_memory_estimate(tile, head_dim, dtype) <= shared_memory_limit(capability)
        if fits and tile not in out:
            out.append(tile)
    return out
