"""Tile and split-K choice for the quantized linears (quant_gemv / quant_gemm), in one table.

`choose_tile` picks, for one call (bits, group, M, N, K) on a device (SM count, compute capability):
1. the kernel: the GEMV up to GEMV_MAX_M activation rows (each weight byte read once per row, L2 serving the rows
   after the first), the GEMM above (each dequantized weight tile shared by BLOCK_M rows through tl.dot);
2. the tile: MEASURED[(capability, kernel, bits, group, m_bucket, N, K)] when the shape was tuned on that device
   class (`python bench/quant.py --sweep` prints the winners in this key format), else BASE[(kernel, bits,
   m_bucket)], clamped to the problem;
3. split-K: when the output tiles cannot give every SM work (GEMV: 2 programs per SM, GEMM: 1), the K range is
   split so that they can, keeping at least MIN_SPLIT_K elements of K per split; partials go through
   quant_reduce (deterministic).
Base tiles: GEMV programs stream 4 rows x BLOCK_K (32 bytes per thread per iteration at 4 warps for int4 and
int8: enough loads in flight with several programs per SM, few enough registers to keep them resident); GEMM
tiles 64 wide with BLOCK_K = 128 (two 64-deep dots per int4 tile). These are starting points chosen from the
kernels' arithmetic, not measurements; MEASURED overrides them per shape once a GPU run has swept them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.codegen._host import cdiv, next_power_of_2

GEMV_MAX_M = 4
MIN_SPLIT_K = 512  # no split covers fewer k than this: below it the partials' traffic outweighs the gain
MAX_SPLIT_K = 16
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y (and z) axis


@dataclass(frozen=True)
class QuantTile:
    """One launch configuration; block_m is 1 for the GEMV (its grid has one program row per activation row)."""

    kernel: str  # quant_gemv | quant_gemm
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def k_split(self, k: int) -> int:
        """Elements of K each split covers: a multiple of block_k."""
        return cdiv(cdiv(k, self.split_k), self.block_k) * self.block_k


def m_bucket(m: int) -> int:
    """The row-count class a tile is chosen for: the GEMV's rows as they are, then GEMM BLOCK_M 16 / 32 / 64."""
    if m <= GEMV_MAX_M:
        return m
    return 16 if m <= 16 else 32 if m <= 32 else 64


BASE: dict[tuple[str, int, int], QuantTile] = {
    **{("quant_gemv", 4, m): QuantTile("quant_gemv", 1, 4, 2048) for m in range(1, GEMV_MAX_M + 1)},
    **{("quant_gemv", 8, m): QuantTile("quant_gemv", 1, 4, 1024) for m in range(1, GEMV_MAX_M + 1)},
    **{("quant_gemm", bits, bm): QuantTile("quant_gemm", bm, 64, 128, num_stages=3) for bits in (4, 8)
       for bm in (16, 32, 64)},
}  # fmt: skip

# Winners of `bench/quant.py --sweep` per (capability, kernel, bits, group, m_bucket, N, K); nothing measured yet
# (no GPU run since these kernels were written), so every shape uses BASE and the split-K rule.
MEASURED: dict[tuple[tuple[int, int], str, int, int, int, int, int], QuantTile] = {}


def min_block_k(bits: int, group: int) -> int:
    """The smallest legal BLOCK_K: an int4 block (32), a Q8_0 group (32), an int8 block (16, a dot's depth)."""
    return 32 if bits == 4 or group else 16


def _clamp(t: QuantTile, bits: int, group: int, m: int, n: int, k: int) -> QuantTile:
    block_k = max(min_block_k(bits, group), min(t.block_k, next_power_of_2(k)))
    if t.kernel == "quant_gemm":
        block_m = max(16, min(t.block_m, next_power_of_2(m)))
        return replace(t, block_m=block_m, block_n=max(16, min(t.block_n, next_power_of_2(n))), block_k=block_k)
    # The GEMV's grid holds the N blocks on axis 1, which CUDA caps at 65535 (a 262k-vocabulary lm_head at 4 rows)
    block_n = max(1, min(t.block_n, next_power_of_2(n)), next_power_of_2(cdiv(n, MAX_GRID_Y)))
    return replace(t, block_m=1, block_n=block_n, block_k=block_k)


def with_split(t: QuantTile, m: int, n: int, k: int, sm_count: int, min_k: int = 32) -> QuantTile:
    """t with split_k (and a block_k that gives each split at least two K steps) chosen so the grid covers the
    SMs; min_k: the smallest legal block_k (min_block_k)."""
    tiles = cdiv(m, t.block_m) * cdiv(n, t.block_n)
    target = (2 if t.kernel == "quant_gemv" else 1) * sm_count
    split = min(cdiv(target, tiles), k // MIN_SPLIT_K, MAX_SPLIT_K) if tiles < target else 1
    if split < 2:
        return replace(t, split_k=1)
    block_k = max(min_k, min(t.block_k, next_power_of_2(cdiv(k, split)) // 2))
    t = replace(t, block_k=block_k, split_k=split)
    return replace(t, split_k=cdiv(k, t.k_split(k)))  # no empty split after rounding to block_k


def choose_tile(
    bits: int,
    group: int,
    m: int,
    n: int,
    k: int,
    *,
    sm_count: int,
    capability: tuple[int, int] = (0, 0),
    kernel: str | None = None,
) -> QuantTile:
    """The launch configuration for one quantized linear (see the module docstring). group: the int4 group, or
    the int8 per-group scales' group (GGUF's Q8_0), 0 for per-channel int8. kernel forces the family."""
    kernel = kernel or ("quant_gemv" if m <= GEMV_MAX_M else "quant_gemm")
    bucket = min(m, GEMV_MAX_M) if kernel == "quant_gemv" else max(16, m_bucket(m))
    measured = MEASURED.get((capability, kernel, bits, group, bucket, n, k))
    if measured is not None:
        return measured
    base = _clamp(BASE[(kernel, bits, bucket)], bits, group, m, n, k)
    return with_split(base, m, n, k, sm_count, min_block_k(bits, group))
