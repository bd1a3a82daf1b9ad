"""Host wrappers for the Mixture-of-Depths kernels (kiln.ir.ops_mod has the semantics):

- kiln::mod_route (router score, threshold, compaction of the selected rows and their gather) and kiln::mod_gather
  (the same compaction and gather for a given mask), in two launches parallel over (row block, sequence):
  templates/mod_select.py.j2 scores each block's rows (mod_route stores r) and counts the selected ones per
  block; templates/mod_route.py.j2 then gives each block its first compact row (the counts of the blocks before
  it, an exclusive scan each program does over its sequence's counts), writes its selected rows' index, xpos and
  xs (features split over a third grid axis) in order, and writes the padding rows count..ROWS-1 it owns. The
  compact rows keep the tokens' order, every output element has one writer and nothing is atomic, so the result
  is deterministic and equal to the reference ops'. The per-block counts are a scratch buffer of the wrapper.
- templates/mod_scatter.py.j2: kiln::mod_scatter (the router-weighted scatter-add fused with the residual add),
  parallel over (compact row block, sequence, feature block).

Kernel arguments are passed by name; route_tiles picks the tiles. Compact batches have a static row count C with
a per-sequence count; see passes/mod_routing.py for why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen._host import (
    FLOAT_DTYPES,
    cdiv,
    check_out,
    check_same_device,
    check_tensor,
    launch,
    next_power_of_2,
)
from kiln.errors import CodegenError

_INTS = (torch.int64, torch.int32)
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (sequences, feature blocks)


@dataclass(frozen=True)
class RouteTiles:
    """Tiles of the MoD kernels. block_t: rows per program, the unit whose selected rows launch 1 counts (and
    compact rows per program of mod_scatter); block_d: features per program of the gathers and per step of the
    score's loop; block_s: per-block counts summed per step of launch 2's offset scan; num_warps: per program."""

    block_t: int
    block_d: int
    block_s: int
    num_warps: int


def route_tiles(t: int, d: int) -> RouteTiles:
    """Tiles for x [B, t, d]. 32 x 128 tiles (16 KiB of fp32 per step of the score) give a flat batch of 8192 rows
    256 row blocks and, at d = 4096, 8192 gather programs: enough to fill a GPU, while the offset scan stays a few
    hundred ints per program. block_s takes every block count in one step up to 1024 blocks (32768 rows)."""
    block_t = 32
    blocks = max(cdiv(t, block_t), 1)
    return RouteTiles(block_t=block_t, block_d=min(next_power_of_2(d), 128),
                      block_s=min(max(next_power_of_2(blocks), 16), 1024), num_warps=4)


def _check_grid(op: str, b: int) -> None:
    if b > _MAX_GRID_YZ:  # sequences are the grid's second axis (row blocks the first, which may be far longer)
        raise CodegenError(f"{op}: a batch of {b} sequences exceeds the kernel grid's {_MAX_GRID_YZ}; "
                           f"run it in parts of at most {_MAX_GRID_YZ} sequences")


def _check_rows(x: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int]:
    check_tensor(x, "x", ndim=3)
    check_tensor(positions, "positions", ndim=2, dtypes=_INTS, unit_last_stride=False)
    b, t, d = x.shape
    if tuple(positions.shape) != (b, t):
        raise CodegenError(f"positions has shape {tuple(positions.shape)}; x {tuple(x.shape)} needs [{b}, {t}]")
    return b, t, d


def _out(out: dict | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The caller's buffer out[name] (checked: contiguous, this shape and dtype) or a new one."""
    t = (out or {}).get(name)
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise CodegenError(f"out[{name!r}] must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, "
                           f"got {t.dtype} {list(t.shape)} on {t.device}")
    return t


def _compact(op: str, x: torch.Tensor, positions: torch.Tensor, rows: int, score: bool, keep: torch.Tensor | None,
             weight: torch.Tensor | None, bias: torch.Tensor | None, threshold: torch.Tensor | None,
             out: dict | None):
    b, t, d = x.shape
    dev = x.device
    r = _out(out, "r", (b, t), torch.float32, dev)
    index = _out(out, "index", (b, rows), torch.int64, dev)
    count = _out(out, "count", (b,), torch.int64, dev)
    xs = _out(out, "xs", (b, rows, d), x.dtype, dev)
    xpos = _out(out, "xpos", (b, rows), torch.int64, dev)
    if b == 0:
        return r, index, count, xs, xpos
    _check_grid(op, b)
    assert 0 <= rows <= t, (rows, t)  # padding row c is written by the program of row block c // block_t
    tiles = route_tiles(t, d)
    nb = max(cdiv(t, tiles.block_t), 1)  # one block even for t = 0, which writes the count
    counts = torch.empty((b, nb), dtype=torch.int32, device=dev)  # launch 1's selected rows per row block
    keep = r if score else keep  # SCORE: launch 2 reads the scores launch 1 stored
    options = {"num_warps": tiles.num_warps}
    select = {
        "x_ptr": x, "w_ptr": weight if score else x, "b_ptr": bias if score else x,
        "thr_ptr": threshold if score else x, "keep_ptr": keep, "r_ptr": r, "counts_ptr": counts, "T": t, "D": d,
        "stride_xb": x.stride(0), "stride_xt": x.stride(1), "stride_kb": keep.stride(0),
        "stride_kt": keep.stride(1), "stride_rb": r.stride(0), "stride_cb": counts.stride(0),
    }  # fmt: skip
    consts = {"SCORE": score, "BLOCK_T": tiles.block_t, "BLOCK_D": tiles.block_d}
    launch("mod_select", op, (nb, b), select, consts, options)
    route = {
        "x_ptr": x, "pos_ptr": positions, "thr_ptr": threshold if score else x, "keep_ptr": keep,
        "counts_ptr": counts, "index_ptr": index, "count_ptr": count, "xs_ptr": xs, "xpos_ptr": xpos,
        "T": t, "D": d, "ROWS": rows, "NB": nb,
        "stride_xb": x.stride(0), "stride_xt": x.stride(1), "stride_pb": positions.stride(0),
        "stride_pt": positions.stride(1), "stride_kb": keep.stride(0), "stride_kt": keep.stride(1),
        "stride_cb": counts.stride(0), "stride_ib": index.stride(0), "stride_sb": xs.stride(0),
        "stride_st": xs.stride(1), "stride_qb": xpos.stride(0),
    }  # fmt: skip
    nd = max(cdiv(d, tiles.block_d), 1)  # one feature block even for d = 0, which writes index and count
    launch("mod_route", op, (nb, b, nd), route, consts | {"BLOCK_S": tiles.block_s}, options)
    return r, index, count, xs, xpos


def mod_route(x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              threshold: torch.Tensor, *, out: dict[str, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kiln::mod_route: (r [B, T] fp32, index [B, T], count [B], xs [B, T, D], xpos [B, T]) for x [B, T, D].

    out: buffers to write into, by output name (r, index, count, xs, xpos); any not given are allocated."""
    b, t, d = _check_rows(x, positions)
    check_tensor(weight, "router weight", ndim=2)
    for name, v in (("router bias", bias), ("router threshold", threshold)):
        check_tensor(v, name, ndim=1, dtypes=FLOAT_DTYPES)
        if v.numel() != 1:
            raise CodegenError(f"{name} must hold one value, got shape {tuple(v.shape)}")
    if tuple(weight.shape) != (1, d):
        raise CodegenError(f"router weight has shape {tuple(weight.shape)}; x with {d} features needs [1, {d}]")
    check_same_device(x=x, positions=positions, weight=weight, bias=bias, threshold=threshold)
    return _compact("mod_route", x, positions, t, True, None, weight, bias, threshold, out)


def mod_gather(
    x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: int, *, out: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kiln::mod_gather with its compact row count given: (index, count, xs, xpos) of the rows `mask` [B, T]
    selects, in order, padded to `rows` (kiln.ir.ops_mod.mod_rows(capacity, T)); out as in mod_route."""
    b, t, d = _check_rows(x, positions)
    check_tensor(mask, "mask", ndim=2, dtypes=(torch.bool,), unit_last_stride=False)
    if tuple(mask.shape) != (b, t):
        raise CodegenError(f"mask has shape {tuple(mask.shape)}; x {tuple(x.shape)} needs [{b}, {t}]")
    if not 0 <= rows <= t:
        raise CodegenError(f"rows = {rows} compact rows for {t} tokens; it must be in 0..{t}")
    check_same_device(x=x, positions=positions, mask=mask)
    _, index, count, xs, xpos = _compact("mod_gather", x, positions, rows, False, mask, None, None, None, out)
    return index, count, xs, xpos


def mod_scatter(x: torch.Tensor, ys: torch.Tensor, r: torch.Tensor, index: torch.Tensor, count: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """kiln::mod_scatter: x with its routed rows replaced by x + r * (ys - x), in `out` or a new tensor."""
    check_tensor(x, "x", ndim=3)
    check_tensor(ys, "ys", ndim=3, dtypes=(x.dtype,))
    check_tensor(r, "r", ndim=2, dtypes=(torch.float32,))
    check_tensor(index, "index", ndim=2, dtypes=(torch.int64,))
    check_tensor(count, "count", ndim=1, dtypes=(torch.int64,))
    b, t, d = x.shape
    rows = ys.shape[1]
    if ys.shape[0] != b or ys.shape[2] != d or tuple(index.shape) != (b, rows) or tuple(r.shape) != (b, t):
        raise CodegenError(f"mod_scatter: x {tuple(x.shape)}, ys {tuple(ys.shape)}, r {tuple(r.shape)} and index "
                           f"{tuple(index.shape)} disagree; expected ys [{b}, C, {d}], r [{b}, {t}], index [{b}, C]")
    check_same_device(x=x, ys=ys, r=r, index=index, count=count)
    out = check_out(out, x)
    out.copy_(x)  # the unrouted rows; the kernel writes the routed ones
    if b > 0 and rows > 0:
        args = {
            "x_ptr": x, "ys_ptr": ys, "r_ptr": r, "index_ptr": index, "count_ptr": count, "out_ptr": out,
            "D": d, "ROWS": rows, "stride_xb": x.stride(0), "stride_xt": x.stride(1), "stride_yb": ys.stride(0),
            "stride_yt": ys.stride(1), "stride_rb": r.stride(0), "stride_ib": index.stride(0),
            "stride_ob": out.stride(0), "stride_ot": out.stride(1),
        }  # fmt: skip
        _check_grid("mod_scatter", b)
        tiles = route_tiles(t, d)
        consts = {"BLOCK_C": tiles.block_t, "BLOCK_D": tiles.block_d}
        grid = (cdiv(rows, tiles.block_t), b, max(cdiv(d, tiles.block_d), 1))
        launch("mod_scatter", "mod_scatter", grid, args, consts, {"num_warps": tiles.num_warps})
    return out
