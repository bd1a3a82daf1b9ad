"""The parallel Mixture-of-Depths compaction (codegen/mod.py: mod_select then mod_route, grid over row blocks) and
mod_scatter, against the reference ops: designed selections that straddle row-block edges, every row or none,
truncation to fewer compact rows than selected, several sequences, fp32 / bf16 / fp16, the score and the keep-mask
forms, and both the default tiles and tiny ones (many row blocks, several steps of the offset scan, several
feature blocks). Outputs are poisoned before each run, so an element no program writes shows up.
"""

from __future__ import annotations

import pytest
import torch

from kiln.codegen import mod
from kiln.codegen.mod import RouteTiles, mod_gather, mod_route, mod_scatter, route_tiles
from kiln.ir.ops_mod import mod_rows
from tests.support.cuda_compile import compile_in_subprocess, ptxas_available

ops = torch.ops.kiln
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every dtype at the default tiles; the tiny tiles (which need more interpreted programs) in a 16-bit dtype.
TILES_DTYPES = [("default", torch.float32), ("default", torch.bfloat16), ("default", torch.float16),
                ("tiny", torch.bfloat16)]
# block_t 4 with block_s 2: a 37-row sequence has 10 row blocks and the offset scan takes 5 steps; block_d 8 splits
# 20 features into 3 blocks, the last one partial.
TINY = RouteTiles(block_t=4, block_d=8, block_s=2, num_warps=1)


def _pattern(kind: str, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """bool [b, t]: which rows are selected. "edges": the rows on both sides of every 32- and 4-row boundary
    (the default and tiny row blocks) plus random ones; "mixed": sequence 0 all, 1 none, the rest random."""
    rand = torch.rand(b, t, generator=g) < 0.4
    i = torch.arange(t)
    if kind == "edges":
        return rand | ((i % 32 == 31) | (i % 32 == 0) | (i % 4 == 3) | (i % 4 == 0))[None, :]
    if kind == "all":
        return torch.ones(b, t, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(b, t, dtype=torch.bool)
    if kind == "mixed":
        return torch.cat([torch.ones(1, t, dtype=torch.bool), torch.zeros(1, t, dtype=torch.bool), rand[2:]])
    raise AssertionError(kind)


def _inputs(b: int, t: int, d: int, kind: str, dtype: torch.dtype, seed: int):
    """x, positions, the selection, and a router (weight on feature 1, bias 0, threshold 0) whose exact score
    x[..., 1] is > 0 on the selected rows only, so the score form selects the same rows in every dtype."""
    g = torch.Generator().manual_seed(seed)
    keep = _pattern(kind, b, t, g)
    x = torch.randn(b, t, d, generator=g)
    x[..., 1] = torch.where(keep, 1.0, -1.0) * (0.5 + torch.rand(b, t, generator=g))
    positions = torch.arange(t) + torch.randint(0, 50, (b, 1), generator=g)  # offset per sequence
    weight = torch.zeros(1, d)
    weight[0, 1] = 1.0
    to = dict(device=DEVICE)
    return x.to(dtype=dtype, **to), positions.to(**to), keep.to(**to), weight.to(dtype=dtype, **to)


def _poisoned(b: int, t: int, rows: int, d: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    i64 = dict(dtype=torch.int64, device=DEVICE)
    return {"r": torch.full((b, t), float("nan"), device=DEVICE), "index": torch.full((b, rows), -7, **i64),
            "count": torch.full((b,), -7, **i64), "xpos": torch.full((b, rows), -7, **i64),
            "xs": torch.full((b, rows, d), float("nan"), dtype=dtype, device=DEVICE)}


def _exact(got: tuple, want: tuple, names: tuple[str, ...]) -> None:
    """The compaction copies and counts: every output equals the reference bit for bit."""
    for name, o, w in zip(names, got, want, strict=True):
        assert o.dtype == w.dtype and o.shape == w.shape, f"{name}: {o.dtype}{list(o.shape)} vs {w.dtype}"
        assert torch.equal(o, w), f"{name} differs from the reference:\n{o}\nvs\n{w}"


# (b, t, d, selection, compact rows: t keeps every selected row)
CASES = [
    (1, 131, 24, "edges", 131),  # 5 default row blocks, selected rows on both sides of every edge
    (3, 70, 40, "mixed", 70),  # per sequence: all, none, random
    (2, 97, 20, "edges", 21),  # truncation: ~70 selected, 21 compact rows
    (2, 64, 16, "all", 33),  # every row selected, 33 kept
    (1, 33, 136, "none", 33),  # every compact row is padding; 2 default feature blocks
    (2, 37, 20, "all", 37),
    (2, 19, 24, "edges", 19),  # one default row block
]


def _capacity(rows: int, t: int) -> float:
    """The capacity for which the reference keeps `rows` compact rows of t."""
    assert mod_rows(rows / t, t) == rows
    return rows / t


def _tiles(monkeypatch, tiles: str) -> None:
    if tiles == "tiny":
        monkeypatch.setattr(mod, "route_tiles", lambda t, d: TINY)


@pytest.mark.parametrize(("tiles", "dtype"), TILES_DTYPES, ids=str)
@pytest.mark.parametrize(("b", "t", "d", "kind", "rows"), CASES)
def test_gather_compacts_in_order_like_the_reference(monkeypatch, tiles, dtype, b, t, d, kind, rows):
    _tiles(monkeypatch, tiles)
    x, positions, keep, _ = _inputs(b, t, d, kind, dtype, seed=t + d)
    want = ops.mod_gather(x, positions, keep, _capacity(rows, t))
    out = _poisoned(b, t, rows, d, dtype)
    got = mod_gather(x, positions, keep, rows, out=out)
    assert all(o is out[n] for o, n in zip(got, ("index", "count", "xs", "xpos"), strict=True))
    _exact(got, want, ("index", "count", "xs", "xpos"))
    selected = keep.sum(-1)
    assert torch.equal(got[1], selected.clamp(max=rows))
    if rows < t and kind != "none":
        assert bool((selected > rows).all()), "the case must truncate"


@pytest.mark.parametrize(("tiles", "dtype"), TILES_DTYPES, ids=str)
@pytest.mark.parametrize(("b", "t", "d", "kind"), [c[:4] for c in CASES if c[4] == c[1]])
def test_route_scores_selects_and_compacts_like_the_reference(monkeypatch, tiles, dtype, b, t, d, kind):
    _tiles(monkeypatch, tiles)
    x, positions, keep, weight = _inputs(b, t, d, kind, dtype, seed=t * d)
    bias, thr = torch.zeros(1, dtype=dtype, device=DEVICE), torch.zeros(1, dtype=dtype, device=DEVICE)
    want = ops.mod_route(x, positions, weight, bias, thr)
    assert torch.equal(want[0] > 0, keep)  # the designed router selects exactly `keep`
    got = mod_route(x, positions, weight, bias, thr, out=_poisoned(b, t, t, d, dtype))
    _exact(got, want, ("r", "index", "count", "xs", "xpos"))


@pytest.mark.parametrize(("tiles", "dtype"), TILES_DTYPES, ids=str)
@pytest.mark.parametrize(("b", "t", "d", "kind", "rows"), CASES)
def test_scatter_writes_back_every_real_compact_row(monkeypatch, tiles, dtype, b, t, d, kind, rows):
    _tiles(monkeypatch, tiles)
    x, positions, keep, _ = _inputs(b, t, d, kind, dtype, seed=b + t + d)
    index, count, xs, _ = ops.mod_gather(x, positions, keep, _capacity(rows, t))
    g = torch.Generator().manual_seed(t)
    ys = xs + torch.randn(xs.shape, generator=g).to(device=DEVICE, dtype=dtype)
    r = torch.randn(b, t, generator=g).to(DEVICE)
    want = ops.mod_scatter(x, ys, r, index, count)
    got = mod_scatter(x, ys, r, index, count, out=torch.full_like(x, float("nan")))
    torch.testing.assert_close(got, want)  # one fp32 formula, rounded once to x's dtype in both
    routed = torch.zeros(b, t, dtype=torch.bool, device=DEVICE)
    for s in range(b):
        routed[s, index[s, : count[s]]] = True
    assert torch.equal(got[~routed], x[~routed])  # untouched rows are x exactly, never a padding row's write


def test_empty_sequences_still_write_their_count():
    x = torch.zeros(2, 0, 8, device=DEVICE)
    positions = torch.zeros(2, 0, dtype=torch.int64, device=DEVICE)
    index, count, xs, xpos = mod_gather(x, positions, torch.zeros(2, 0, dtype=torch.bool, device=DEVICE), 0,
                                        out={"count": torch.full((2,), -7, dtype=torch.int64, device=DEVICE)})
    assert count.tolist() == [0, 0] and index.shape == (2, 0) and xs.shape == (2, 0, 8) and xpos.shape == (2, 0)


def test_default_tiles_are_powers_of_two_and_scan_long_batches_in_one_step():
    for t, d in ((1, 8), (37, 40), (8192, 4096), (32768, 2048), (100_000, 24)):
        tiles = route_tiles(t, d)
        for size in (tiles.block_t, tiles.block_d, tiles.block_s):  # tl.arange takes powers of two only
            assert size > 0 and size & (size - 1) == 0, (t, d, tiles)
        assert tiles.block_d <= 128 and tiles.block_s <= 1024  # registers per program stay bounded
        if t <= 32768:
            assert tiles.block_s * tiles.block_t >= t, (t, tiles)  # every block count in one step of the scan


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_a_long_flat_batch_on_the_gpu(dtype):
    """The step graph's shape: one sequence of N rows. Row-parallel, so no program walks the batch."""
    x, positions, keep, weight = _inputs(1, 8191, 4096, "edges", dtype, seed=3)
    bias, thr = torch.zeros(1, dtype=dtype, device=DEVICE), torch.zeros(1, dtype=dtype, device=DEVICE)
    _exact(mod_route(x, positions, weight, bias, thr), ops.mod_route(x, positions, weight, bias, thr),
           ("r", "index", "count", "xs", "xpos"))
    _exact(mod_gather(x, positions, keep, 2000), ops.mod_gather(x, positions, keep, _capacity(2000, 8191)),
           ("index", "count", "xs", "xpos"))


def _request(template: str, op: str, consts: dict, arch: int, dtypes: dict, divisible: list[str]) -> dict:
    return {"template": template, "name": f"{template}_kernel", "op": op, "consts": consts, "arch": arch,
            "options": {"num_warps": route_tiles(8192, 4096).num_warps}, "dtypes": dtypes, "divisible": divisible}


@pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")
def test_the_kernels_compile_for_h100_and_a100():
    """Built by triton's own ptxas for sm90 / sm80 in a subprocess (this one has TRITON_INTERPRET=1), at the tiles
    a flat batch of 8192 rows of 4096 features gets, in both forms and with int32 / int64 positions."""
    tiles = route_tiles(8192, 4096)
    tile = {"BLOCK_T": tiles.block_t, "BLOCK_D": tiles.block_d}
    ints = {"counts_ptr": "*i32", "index_ptr": "*i64", "count_ptr": "*i64", "xpos_ptr": "*i64"}
    rows = ["stride_xt", "stride_st"]
    requests = [
        _request("mod_select", "mod_route", {"SCORE": True, **tile}, 90,
                 {"*": "*bf16", "r_ptr": "*fp32", "keep_ptr": "*fp32", "counts_ptr": "*i32"}, rows),
        _request("mod_select", "mod_gather", {"SCORE": False, **tile}, 80,
                 {"*": "*fp16", "r_ptr": "*fp32", "keep_ptr": "*i1", "counts_ptr": "*i32"}, rows),
        _request("mod_route", "mod_route", {"SCORE": True, **tile, "BLOCK_S": tiles.block_s}, 90,
                 {"*": "*bf16", "pos_ptr": "*i64", "keep_ptr": "*fp32", **ints}, rows),
        _request("mod_route", "mod_gather", {"SCORE": False, **tile, "BLOCK_S": tiles.block_s}, 80,
                 {"*": "*fp16", "pos_ptr": "*i32", "keep_ptr": "*i1", **ints}, rows),
        _request("mod_scatter", "mod_scatter", {"BLOCK_C": tiles.block_t, "BLOCK_D": tiles.block_d}, 90,
                 {"*": "*bf16", "r_ptr": "*fp32", "index_ptr": "*i64", "count_ptr": "*i64"},
                 ["stride_xt", "stride_yt", "stride_ot"]),
    ]
    results = compile_in_subprocess(requests)
    for req, res in zip(requests, results, strict=True):
        assert res["shared"] <= 4096, (req, res)  # only reductions' scratch: no tile is staged in shared memory
