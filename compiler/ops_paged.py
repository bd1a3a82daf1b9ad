"""kiln's paged-KV-cache op: attention for one step over a flat batch, with K/V in a shared block pool.

- kiln::paged_attention(q, k, v, kv_cache, layer, slot_mapping, block_tables, context_lens, query_start_loc,
  max_query_len, max_context_len, num_heads, num_kv_heads, causal, window, scale) -> out
  q [1, N, H * D], k/v [1, N, Hkv * D] hold the new tokens of every scheduled sequence, concatenated
  (sequence i owns rows query_start_loc[i]:query_start_loc[i + 1]). First each new token's k/v is written to
  kv_cache[layer, 0 / 1] at its slot (slot s is block s // block_size, offset s % block_size; a negative slot
  is padding and is not written). Then sequence i's new queries attend over its first context_lens[i] cached
  keys (its blocks in block_tables[i] order), queries aligned to the end of the keys: a prefill chunk after a
  cached prefix and a decode (one query) are the same computation. Semantics per sequence are kiln::attention
  (GQA by head counts, causal, window > 0 keeps the last `window` keys including the query itself).
  max_query_len / max_context_len are host-side bounds for kernels (grid sizes); the reference ignores them.

The op mutates kv_cache (mutates_args), so its schema is mutable: fx's dead-code elimination keeps it, and
FakeTensor propagation runs the fake kernel, which leaves the cache alone. The layout of kv_cache is
runtime.step's [layers, 2, num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import torch
from torch.library import custom_op

import kiln.ops  # noqa: F401  (the Level-1 ops the reference calls)

kiln_ops = torch.ops.kiln


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' k/v rows ([N, Hkv * D] or [1, N, Hkv * D]) into their cache slots (in place)."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for i, t in enumerate((k, v)):
        rows = t.reshape(-1, kv_heads, head_dim)[keep]
        kv_cache[layer, i, blocks, offsets] = rows.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `context_len` cached keys and values as contiguous [1, context_len, Hkv * D]."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    pos = torch.arange(context_len, device=kv_cache.device)
    blocks = block_table.to(torch.int64)[pos // block_size]
    k = kv_cache[layer, 0, blocks, pos % block_size]
    v = kv_cache[layer, 1, blocks, pos % block_size]
    return k.reshape(1, context_len, kv_heads * head_dim), v.reshape(1, context_len, kv_heads * head_dim)


@custom_op("kiln::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend each sequence's new queries over its cache."""
    write_kv(k, v, kv_cache, layer, slot_mapping)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()  # the reference may sync with the host; the kernels never do
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys, values = gather_kv(kv_cache, layer, block_tables[i], ctx)
        qs = q[:, lo:hi]
        out[:, lo:hi] = kiln_ops.attention.default(
            qs, keys.to(q.dtype), values.to(q.dtype), num_heads, num_kv_heads, causal, window, scale
        )
    return out


@paged_attention.register_fake
def _(q, k, v, kv_cache, layer, slot_mapping, block_tables, context_lens, query_start_loc, max_query_len,
      max_context_len, num_heads, num_kv_heads, causal, window, scale):  # fmt: skip
    return torch.empty_like(q)


PAGED_OPS = (kiln_ops.paged_attention.default,)
