"""Host wrappers for the Mixture-of-Depths kernels (kiln.ir.ops_mod has the semantics):

- templates/mod_route.py.j2: kiln::mod_route (router score, threshold, compaction of the selected rows' indices
  and their gather, in one kernel) and kiln::mod_gather (the same compaction and gather for a given mask);
- templates/mod_scatter.py.j2: kiln::mod_scatter (the router-weighted scatter-add fused with the residual add).

Kernel arguments are passed by name. Compact batches have a static row count C with a per-sequence count; see
passes/mod_routing.py for why.
"""

from __future__ import annotations

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
_BLOCK_T = 32


def _block_d(d: int) -> int:
    return min(next_power_of_2(d), 128)


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
    keep = keep if keep is not None else r  # unread when SCORE
    args = {
        "x_ptr": x, "pos_ptr": positions, "w_ptr": weight if score else x, "b_ptr": bias if score else x,
        "thr_ptr": threshold if score else x, "keep_ptr": keep,
        "r_ptr": r, "index_ptr": index, "count_ptr": count, "xs_ptr": xs, "xpos_ptr": xpos,
        "T": t, "D": d, "ROWS": rows,
        "stride_xb": x.stride(0), "stride_xt": x.stride(1), "stride_pb": positions.stride(0),
        "stride_pt": positions.stride(1), "stride_kb": keep.stride(0), "stride_kt": keep.stride(1),
        "stride_rb": r.stride(0), "stride_ib": index.stride(0), "stride_sb": xs.stride(0), "stride_st": xs.stride(1),
        "stride_qb": xpos.stride(0),
    }  # fmt: skip
    if b > 0:
        consts = {"SCORE": score, "BLOCK_T": _BLOCK_T, "BLOCK_D": _block_d(d)}
        launch("mod_route", op, (b,), args, consts, {"num_warps": 4})
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
        consts = {"BLOCK_C": _BLOCK_T, "BLOCK_D": _block_d(d)}
        launch("mod_scatter", "mod_scatter", (b, cdiv(rows, _BLOCK_T)), args, consts, {"num_warps": 4})
    return out
