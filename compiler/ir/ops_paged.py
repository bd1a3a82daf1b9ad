"""kiln's paged-KV-cache op: attention for one step over a flat batch, with K/V in a shared block pool.

- kiln::paged_attention(q, k, v, kv_cache, layer, slot_mapping, block_tables, context_lens, query_start_loc,
  max_query_len, max_context_len, num_heads, num_kv_heads, causal, window, scale, kv_scales) -> out
  q [1, N, H * D], k/v [1, N, Hkv * D] hold the new tokens of every scheduled sequence, concatenated
  (sequence i owns rows query_start_loc[i]:query_start_loc[i + 1]). First each new token's k/v is written to
  kv_cache[layer, 0 / 1] at its slot (slot s is block s // block_size, offset s % block_size; a negative slot
  is padding and is not written). Then sequence i's new queries attend over its first context_lens[i] cached
  keys (its blocks in block_tables[i] order), queries aligned to the end of the keys: a prefill chunk after a
  cached prefix and a decode (one query) are the same computation. Semantics per sequence are kiln::attention
  (GQA by head counts, causal, window > 0 keeps the last `window` keys including the query itself). Rows past
  query_start_loc[S] belong to no sequence (a routed layer's compact padding rows): their output is zeros.
  max_query_len / max_context_len are host-side bounds for kernels (grid sizes); the reference ignores them.

kv_scales is always passed (None for a cache that is not int8) and has no default on purpose: torch 2.11's
dispatcher drops a trailing argument equal to its default from the call stack, and the ADInplaceOrView kernel
then indexes a mutated argument past the end of the stack (IndexError in fake propagation). A mutated argument
must never have a default; tests/test_op_schemas.py enforces it for every kiln op.

The op mutates kv_cache (mutates_args), so its schema is mutable: fx's dead-code elimination keeps it, and
FakeTensor propagation runs the fake kernel, which leaves the cache alone. The layout of kv_cache is
runtime.step's [layers, 2, num_blocks, block_size, kv_heads, head_dim].

int8 KV cache: kv_cache is int8 and kv_scales fp32 [layers, 2, num_blocks, block_size, kv_heads] holds one
symmetric scale per cached token and kv head (scale = absmax / 127 over head_dim; quantize_kv). The write
quantizes, the gather dequantizes; the kernels do the same arithmetic, so the written cache is bit-identical.
"""

from __future__ import annotations

import torch

import kiln.ir.ops  # noqa: F401  (the Level-1 ops the reference calls)
from kiln.errors import KilnError
from kiln.ir.registry import kiln_op, reference
from kiln.ir.signatures import ATTENTION_PARAMS, PAGED_ATTENTION, take

kiln_ops = torch.ops.kiln


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dim: (int8 values, fp32 scales) with x ~ values * scale.

    scale = absmax / 127; values = floor(x * (127 / absmax) + 0.5) (0 for an all-zero row). The paged write
    kernel computes exactly this (IEEE division, fp32), so kernel and reference caches agree bit for bit.
    """
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    values = torch.floor(x * inv + 0.5).clamp(-127, 127).to(torch.int8)
    return values, (absmax / 127.0).squeeze(-1)


def _check_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise KilnError(f"a {kv_cache.dtype} kv_cache {'needs' if kv_scales is None else 'takes no'} kv_scales; "
                         "allocate both with kiln.compile.step.allocate_kv_cache")


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Scatter the new tokens' k/v rows ([N, Hkv * D] or [1, N, Hkv * D]) into their cache slots (in place);
    quantized per token and head when kv_scales is given (an int8 cache)."""
    _check_scales(kv_cache, kv_scales)
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for i, t in enumerate((k, v)):
        rows = t.reshape(-1, kv_heads, head_dim)[keep]
        if kv_scales is None:
            kv_cache[layer, i, blocks, offsets] = rows.to(kv_cache.dtype)
        else:
            kv_cache[layer, i, blocks, offsets], kv_scales[layer, i, blocks, offsets] = quantize_kv(rows)


def gather_kv(
    kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_len: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence's first `context_len` cached keys and values as contiguous [1, context_len, Hkv * D]
    (dequantized to fp32 for an int8 cache)."""
    _check_scales(kv_cache, kv_scales)
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    pos = torch.arange(context_len, device=kv_cache.device)
    blocks, offsets = block_table.to(torch.int64)[pos // block_size], pos % block_size
    out = []
    for i in (0, 1):
        t = kv_cache[layer, i, blocks, offsets]
        if kv_scales is not None:
            t = t.float() * kv_scales[layer, i, blocks, offsets][..., None]
        out.append(t.reshape(1, context_len, kv_heads * head_dim))
    return out[0], out[1]


@kiln_op(PAGED_ATTENTION.op, mutates_args=PAGED_ATTENTION.mutated, schema=PAGED_ATTENTION.schema())
@PAGED_ATTENTION.implements
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
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend each sequence's new queries over its cache."""
    write_kv(k, v, kv_cache, layer, slot_mapping, kv_scales)
    attn = take(ATTENTION_PARAMS, locals())
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()  # the reference may sync with the host; the kernels never do
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys, values = gather_kv(kv_cache, layer, block_tables[i], ctx, kv_scales)
        qs = q[:, lo:hi]
        out[:, lo:hi] = reference("attention")(qs, keys.to(q.dtype), values.to(q.dtype), *attn)
    return out


@paged_attention.register_fake
def _(q, *rest):
    return torch.empty_like(q)


PAGED_OPS = (kiln_ops.paged_attention.default,)
