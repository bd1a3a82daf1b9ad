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
  (bs = routed_kv_cache's block size); padding rows get -1, which the paged write skips;
- block_tables: a copy of routed_block_tables[layer] (a custom op may not return a view of an input);
- routed: 1 for each flat row that was routed (the step graph's compact batch has C = N rows), else 0: the host
  sums it per sequence for the counts, and per dense block for a routed layer's state at a block boundary
  (what prefix caching records).
Everything stays on the device (no host sync); the host learns `routed` with the step's other outputs. Rotary
positions are not touched here: the compact rows keep their original positions (xpos).
"""

from __future__ import annotations

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
