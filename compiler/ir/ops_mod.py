"""kiln's Mixture-of-Depths ops (kiln.model_config.ModConfig has the semantics), each a plain-torch reference
plus a fake kernel.

Level 1, the dense-masked form the frontend emits for a routed layer (every token computed, the unrouted ones
discarded at the end; the oracle):
- kiln::mod_router(x, weight, bias) -> r fp32 [B, T]: r = x @ weight.T + bias
- kiln::mod_predictor(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias) -> fp32 [B, T]: fc2(silu(fc1(x)))
- kiln::mod_topk_mask(score, capacity) -> bool [B, T]: the training form, the top mod_rows(capacity, T) tokens of
  each sequence by score, ties broken by position (the earlier token wins)
- kiln::mod_threshold_mask(score, threshold?) -> bool [B, T]: the causal form, score > threshold (0 when None)
- kiln::routed_attention(q, k, v, routed, H, Hkv, causal, window, scale): kiln::attention among the routed keys
  only. `window` counts routed keys: a query sees the last `window` routed tokens, itself included, which is what
  the compact batch's attention (and a routed layer's own KV cache) computes. An unrouted query's row is
  discarded by mod_combine; it gets the same formula (0 when it sees no key), never NaN.
- kiln::mod_combine(x, y, r, mask) -> where(mask, x + r * (y - x), x), computed in fp32

Level 2, the gathered form the mod_routing pass rewrites it into. A compact batch has a static number of rows,
C = mod_rows(capacity, T): exactly the routed count in the training form, T (the bound) in the causal form,
whose routed count depends on the data; `count` [B] says how many rows of each sequence are real. Rows past the
count hold zeros (position 0) and index 0; they sit after every real row, so causal attention never lets a real
row see them, and mod_scatter ignores them. The step graph may cut a causal form's compact batch to fewer rows at
run time (kiln::mod_narrow in kiln.ir.ops_mod_step): the ops here take their row count from their inputs.
- kiln::mod_route(x, positions, weight, bias, threshold) -> (r, index, count, xs, xpos): router score, the
  causal threshold selection and the gather in one (C = T)
- kiln::mod_gather(x, positions, mask, capacity) -> (index, count, xs, xpos): the gather for a given mask
- kiln::mod_scatter(x, ys, r, index, count) -> x with each routed row i = index[b, c] (c < count[b]) replaced by
  x[i] + r[i] * (ys[b, c] - x[i]): the router-weighted scatter-add fused with the residual add
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kiln.ir.ops  # noqa: F401  (kiln::attention, which the compact form uses)
from kiln.errors import KilnError
from kiln.ir.registry import kiln_op


def mod_rows(capacity: float, seq: int) -> int:
    """Rows a routed layer keeps of a `seq`-token sequence: ceil(capacity * seq), at least 1 (0 for seq 0).

    A hair below the product is taken first so that e.g. 0.1 * 30 (3.0000000000000004 in floats) gives 3."""
    return min(seq, max(1, math.ceil(capacity * seq - 1e-9))) if seq > 0 else 0


@kiln_op("kiln::mod_router", mutates_args=())
def mod_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (x.float() @ weight.float().t())[..., 0] + bias.float()


@mod_router.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


@kiln_op("kiln::mod_predictor", mutates_args=())
def mod_predictor(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
                  fc2_bias: torch.Tensor) -> torch.Tensor:
    h = F.silu(F.linear(x.float(), fc1_weight.float(), fc1_bias.float()))
    return F.linear(h, fc2_weight.float(), fc2_bias.float())[..., 0]


@mod_predictor.register_fake
def _(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


@kiln_op("kiln::mod_topk_mask", mutates_args=())
def mod_topk_mask(score: torch.Tensor, capacity: float) -> torch.Tensor:
    k = mod_rows(capacity, score.shape[-1])
    # A stable descending sort keeps equal scores in position order: ties go to the earlier token.
    top = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros(score.shape, dtype=torch.bool, device=score.device).scatter_(-1, top, True)


@mod_topk_mask.register_fake
def _(score, capacity):
    return score.new_empty(score.shape, dtype=torch.bool)


@kiln_op("kiln::mod_threshold_mask", mutates_args=())
def mod_threshold_mask(score: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    return score > (threshold.float() if threshold is not None else 0.0)


@mod_threshold_mask.register_fake
def _(score, threshold):
    return score.new_empty(score.shape, dtype=torch.bool)


@kiln_op("kiln::routed_attention", mutates_args=())
def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routed: torch.Tensor, num_heads: int,
                     num_kv_heads: int, causal: bool, window: int, scale: float) -> torch.Tensor:
    b, t, _ = q.shape
    if k.shape[1] != t or tuple(routed.shape) != (b, t):
        raise KilnError(f"kiln::routed_attention takes q, k, v and routed over the same {t} tokens, got k "
                        f"{tuple(k.shape)} and routed {tuple(routed.shape)}; it has no cached prefix")
    d = q.shape[2] // num_heads
    qh = q.view(b, t, num_heads, d).transpose(1, 2).float()
    kh = k.view(b, t, num_kv_heads, d).transpose(1, 2).float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    vh = v.view(b, t, num_kv_heads, d).transpose(1, 2).float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    rank = routed.long().cumsum(-1)  # a routed token's 1-based rank among its sequence's routed tokens
    i = torch.arange(t, device=q.device)
    allowed = routed[:, None, :].expand(b, t, t).clone()
    if causal:
        allowed &= i[None, None, :] <= i[None, :, None]
    if window > 0:
        gap = rank[:, :, None] - rank[:, None, :]
        allowed &= (gap < window) if causal else (gap.abs() < window)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    seen = allowed.any(-1)
    # A query with no visible key gives 0. Its row is unmasked before the softmax and zeroed after, so neither
    # the output nor its gradient (kiln.train differentiates this reference) meets a softmax over nothing: NaN.
    scores = scores.masked_fill(~(allowed | ~seen[..., None])[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh
    out = torch.where(seen[:, None, :, None], out, 0.0)
    return out.transpose(1, 2).reshape(b, t, num_heads * d).to(q.dtype)


@routed_attention.register_fake
def _(q, k, v, routed, num_heads, num_kv_heads, causal, window, scale):
    return torch.empty_like(q)


@kiln_op("kiln::mod_combine", mutates_args=())
def mod_combine(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return torch.where(mask[..., None], xf + r[..., None] * (y.float() - xf), xf).to(x.dtype)


@mod_combine.register_fake
def _(x, y, r, mask):
    return torch.empty_like(x)


# ---- Level 2: the gathered form (passes/mod_routing.py) ---------------------------------------------------------


def _gather(x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: int):
    b, t, d = x.shape
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[:, :rows]  # routed first, in order
    count = mask.sum(-1).clamp(max=rows)
    valid = torch.arange(rows, device=x.device)[None, :] < count[:, None]
    index = torch.where(valid, order, 0)
    xs = torch.where(valid[..., None], x.gather(1, index[..., None].expand(b, rows, d)), 0).to(x.dtype)
    xpos = torch.where(valid, positions.gather(1, index), 0)
    return index, count.to(torch.int64), xs, xpos


def _gather_fake(x: torch.Tensor, rows: int):
    b, _, d = x.shape
    index = x.new_empty((b, rows), dtype=torch.int64)
    return index, x.new_empty((b,), dtype=torch.int64), x.new_empty((b, rows, d)), torch.empty_like(index)


@kiln_op("kiln::mod_gather", mutates_args=())
def mod_gather(x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, capacity: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gather(x, positions, mask, mod_rows(capacity, x.shape[1]))


@mod_gather.register_fake
def _(x, positions, mask, capacity):
    return _gather_fake(x, mod_rows(capacity, x.shape[1]))


@kiln_op("kiln::mod_route", mutates_args=())
def mod_route(x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r = mod_router(x, weight, bias)
    return (r, *_gather(x, positions, mod_threshold_mask(r, threshold), x.shape[1]))


@mod_route.register_fake
def _(x, positions, weight, bias, threshold):
    return (x.new_empty(x.shape[:-1], dtype=torch.float32), *_gather_fake(x, x.shape[1]))


@kiln_op("kiln::mod_scatter", mutates_args=())
def mod_scatter(x: torch.Tensor, ys: torch.Tensor, r: torch.Tensor, index: torch.Tensor, count: torch.Tensor
                ) -> torch.Tensor:
    b, rows, d = ys.shape
    valid = torch.arange(rows, device=x.device)[None, :] < count[:, None]
    sel = valid.nonzero(as_tuple=True)  # (sequence, compact row) of every real row
    at = index[sel]
    xr = x[sel[0], at].float()
    out = x.clone()
    out[sel[0], at] = (xr + r[sel[0], at][:, None] * (ys[sel].float() - xr)).to(x.dtype)
    return out


@mod_scatter.register_fake
def _(x, ys, r, index, count):
    return torch.empty_like(x)
