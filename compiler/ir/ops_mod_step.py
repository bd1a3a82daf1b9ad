"""The routed KV cache's step op: where a routed layer's compact rows go in that layer's own paged cache.

- kiln::mod_kv_slots(index, count, query_start_loc, routed_lens, routed_block_tables, routed_kv_cache, layer)
  -> (slot_mapping [C] int64, block_tables [S, W] int32, context_lens [S] int32, query_start_loc [S + 1] int32,
      routed [C] int32)

In the step graph a routed layer runs on the compact batch of the flat batch's routed rows (kiln::mod_route /
kiln::mod_gather over [1, N]: index [1, C] holds the flat row of compact row c, count [1] how many compact rows
are real; padding rows come last). The flat batch is grouped by sequence (sequence s owns rows
query_start_loc[s]:query_start_loc[s + 1]) and compaction keeps the order, so the compact rows are grouped by
sequence too. Routed layer `layer` of sequence s holds routed_lens[layer, s] entries before the step (its routed
length c) in the blocks routed_block_tables[layer, s]; the op gives that layer's paged_attention its inputs:
- counts[s]: how many of s's new rows were routed; query_start_loc: 0 then their running sum;
- context_lens[s] = c + counts[s] (a routed layer's keys are its routed tokens only);
- slot_mapping: the j-th routed row of s goes to entry c + j: slot table[s][(c + j) // bs] * bs + (c + j) % bs
  (bs = routed_kv_cache's block size); padding rows get -1, which the paged write skips. A padding *sequence*
  of the runner's padded decode batches (one dummy token; routed length 0, its tables the null block) is an
  ordinary sequence here: if its row is routed, it writes entry 0 of the routed pool's null block and reads it;
- block_tables: a copy of routed_block_tables[layer] (a custom op may not return a view of an input);
- routed: 1 for each flat row that was routed (the step graph's compact batch has C = N rows), else 0: the host
  sums it per sequence for the counts, and per dense block for a routed layer's state at a block boundary
  (what prefix caching records).
Everything stays on the device (no host sync); the host learns `routed` with the step's other outputs. Rotary
positions are not touched here: the compact rows keep their original positions (xpos).

- kiln::mod_narrow(count, compact, min_rows, bucket) -> the compact tensors cut to their first C' rows
  (passes/kv_cache.py puts one after each routed layer's mod_kv_slots, so that the layer body runs on about its
  routed rows instead of the flat batch's N). `compact` holds a routed layer's compact-batch tensors: index and
  xpos [1, C], xs [1, C, D] (compact rows on dim 1) and each of its attentions' slot_mapping [C] (dim 0). When
  C >= min_rows, C' = count rounded up to a multiple of `bucket`, at most C (never 0: a layer that routed
  nothing keeps one bucket of padding rows); below min_rows, C' = C (nothing changes). Reading the count is a
  device -> host sync, worth it only on steps with many rows (kv_cache_routed.NARROW_MIN_ROWS says why 256). What is
  true of shapes where: FakeTensor propagation (meta["val"], kiln.compile.kernel_requests) gives every output C =
  N rows, the static bound, as the padded path has; at run time they have C' <= C rows, and everything
  downstream (the body, its paged attention, mod_scatter) takes its row count from its inputs. Rows [count, C')
  are the padding rows of the padded path (zeros, position 0, index 0, slot -1; past query_start_loc[S], so
  paged attention gives them zeros too and the body computes on defined values), so the real rows go through
  the same per-row math as there (a GEMM may round differently for another row count). This reference returns
  copies (a custom op may not return its inputs or views of them); the lowered graph's version
  (kiln.compile.lowering) returns views, no copy. It never syncs inside a CUDA graph capture: it keeps C there,
  the padded path, right for every count a replay routes (decode graphs stay below min_rows anyway).
"""

from __future__ import annotations

import math

import torch

from kiln.errors import KilnError
from kiln.ir.registry import kiln_op


@kiln_op("kiln::mod_kv_slots", mutates_args=())
def mod_kv_slots(index: torch.Tensor, count: torch.Tensor, query_start_loc: torch.Tensor, routed_lens: torch.Tensor,
                 routed_block_tables: torch.Tensor, routed_kv_cache: torch.Tensor, layer: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if index.dim() != 2 or index.shape[0] != 1 or tuple(count.shape) != (1,):
        raise KilnError(f"kiln::mod_kv_slots takes the compact batch of one flat step batch (index [1, C], count "
                        f"[1]), got index {tuple(index.shape)} and count {tuple(count.shape)}")
    dev = index.device
    rows = index[0]
    c = rows.shape[0]
    s = query_start_loc.shape[0] - 1
    bs = routed_kv_cache.shape[3]
    table = routed_block_tables[layer]
    valid = torch.arange(c, device=dev) < count[0]
    # Sequence of each compact row: how many sequence ends lie at or before its flat row; padding rows -> s.
    seq = torch.searchsorted(query_start_loc[1:].to(torch.int64).contiguous(), rows, right=True)
    seq = torch.where(valid, seq, s)
    counts = torch.zeros(s + 1, dtype=torch.int64, device=dev).scatter_add_(0, seq, torch.ones_like(seq))[:s]
    qsl = torch.zeros(s + 1, dtype=torch.int64, device=dev)
    qsl[1:] = counts.cumsum(0)
    seq_c = seq.clamp(max=max(s - 1, 0))
    lens = routed_lens[layer].to(torch.int64)
    entry = lens[seq_c] + torch.arange(c, device=dev) - qsl[seq_c]  # c_s + j for the j-th routed row of s
    block = table[seq_c, (entry // bs).clamp(max=max(table.shape[1] - 1, 0))].to(torch.int64)
    slots = torch.where(valid, block * bs + entry % bs, -1)
    flags = torch.zeros(c, dtype=torch.int32, device=dev).scatter_add_(0, torch.where(valid, rows, 0),
                                                                       valid.to(torch.int32))
    return slots, table.clone(), (lens + counts).to(torch.int32), qsl.to(torch.int32), flags


@mod_kv_slots.register_fake
def _(index, count, query_start_loc, routed_lens, routed_block_tables, routed_kv_cache, layer):
    s = query_start_loc.shape[0] - 1
    i32 = dict(dtype=torch.int32)
    return (index.new_empty(index.shape[1:], dtype=torch.int64), routed_block_tables.new_empty(
        routed_block_tables.shape[1:], **i32), query_start_loc.new_empty((s,), **i32),
        query_start_loc.new_empty((s + 1,), **i32), index.new_empty(index.shape[1:], **i32))


def narrow_rows(count: torch.Tensor, rows: int, min_rows: int, bucket: int) -> int:
    """C' of kiln::mod_narrow: the compact rows a routed layer keeps of `rows` (C), reading `count` to the host
    only when rows >= min_rows (and not while a CUDA graph is being captured)."""
    if rows < min_rows or (count.is_cuda and torch.cuda.is_current_stream_capturing()):
        return rows
    routed = int(count.max()) if count.numel() else 0
    return min(rows, max(1, math.ceil(routed / bucket)) * bucket)


def _compact_dim(t: torch.Tensor) -> int:
    return 1 if t.dim() >= 2 else 0


def check_compact(compact: list[torch.Tensor]) -> int:
    """C, the compact row count every tensor of kiln::mod_narrow's `compact` shares (a KilnError otherwise)."""
    sizes = {t.shape[_compact_dim(t)] for t in compact}
    if len(sizes) != 1:
        raise KilnError(f"kiln::mod_narrow takes compact-batch tensors with one row count (dim 1 of [B, C, ...], "
                        f"dim 0 of [C]), got shapes {[tuple(t.shape) for t in compact]}")
    return sizes.pop()


def narrow_compact(compact: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Views of the first `rows` compact rows of each tensor (the tensor itself when it has no more)."""
    return [t if t.shape[_compact_dim(t)] == rows else t.narrow(_compact_dim(t), 0, rows) for t in compact]


@kiln_op("kiln::mod_narrow", mutates_args=())
def mod_narrow(count: torch.Tensor, compact: list[torch.Tensor], min_rows: int, bucket: int) -> list[torch.Tensor]:
    if bucket < 1:
        raise KilnError(f"kiln::mod_narrow: bucket = {bucket}; the rows are rounded up to a multiple of >= 1")
    rows = narrow_rows(count, check_compact(compact), min_rows, bucket) if compact else 0
    return [t.clone() for t in narrow_compact(compact, rows)]


@mod_narrow.register_fake
def _(count, compact, min_rows, bucket):
    check_compact(compact)
    return [torch.empty_like(t) for t in compact]  # C = N, the bound: the count is data
