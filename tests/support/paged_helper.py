"""Building StepBatches by hand for the paged-cache tests: shuffled, non-contiguous blocks per sequence."""

from __future__ import annotations

import torch

from kiln.ir import ops
from kiln.step import StepBatch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shuffled_block_tables(final_lens: list[int], block_size: int, seed: int, spare: int = 3) -> tuple[list, int]:
    """Each sequence's blocks (enough for its final length), drawn from a shuffled pool with spare blocks."""
    need = [cdiv(n, block_size) for n in final_lens]
    num_blocks = sum(need) + spare
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(pool[at : at + n])
        at += n
    return tables, num_blocks


def step_batch(
    seqs: list[list[int]],
    chunks: list[tuple[int, int]],
    tables: list[list[int]],
    block_size: int,
    sample_indices: list[int] | None = None,
    device: str | torch.device = "cpu",
) -> StepBatch:
    """A step where sequence i computes tokens seqs[i][start:end] with seqs[i][:start] already cached.

    chunks[i] = (start, end); rows are the sequences' new tokens in order. sample_indices defaults to each
    sequence's last new row.
    """
    tokens, positions, slots, qsl, ctx = [], [], [], [0], []
    for seq, (start, end), table in zip(seqs, chunks, tables, strict=True):
        for p in range(start, end):
            tokens.append(seq[p])
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + end - start)
        ctx.append(end)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    if sample_indices is None:
        sample_indices = [q - 1 for q in qsl[1:]]

    def i64(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    return StepBatch(
        tokens=i64(tokens),
        positions=i64(positions),
        slot_mapping=i64(slots),
        block_tables=bt.to(device),
        context_lens=i32(ctx),
        query_start_loc=i32(qsl),
        sample_indices=i64(sample_indices),
        max_query_len=max(e - s for s, e in chunks),
        max_context_len=max(ctx),
    )


def row_positions(seqs: list[list[int]], chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(sequence index, position) of every row of a step built from these chunks."""
    return [(i, p) for i, (s, e) in enumerate(chunks) for p in range(s, e)]


LAYERS, LAYER = 2, 1  # write and read layer 1 of 2, so a wrong layer offset shows


def paged_inputs(heads, kv_heads, d, block_size, q_lens, ctx_lens, seed, dtype=torch.float32):
    """A two-layer cache of random K/V in shuffled blocks, queries, and the step's block tables, context lengths and
    query start offsets: (q, cache, tables, block_tables, context_lens, query_start_loc)."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(ctx_lens, block_size, seed)
    cache = torch.randn(LAYERS, 2, num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads * d, generator=g).to(dtype)
    bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cache, tables, bt, torch.tensor(ctx_lens, dtype=torch.int32), qsl


def gathered_attention(q, cache, tables, q_lens, ctx_lens, heads, kv_heads, causal, window, scale):
    """ops.attention per sequence over layer LAYER's K/V gathered position by position from its blocks."""
    block_size, d = cache.shape[3], cache.shape[-1]
    outs, at = [], 0
    for table, q_len, ctx in zip(tables, q_lens, ctx_lens, strict=True):
        where = [(table[p // block_size], p % block_size) for p in range(ctx)]
        k = torch.stack([cache[LAYER, 0, b, o] for b, o in where]).reshape(1, ctx, kv_heads * d)
        v = torch.stack([cache[LAYER, 1, b, o] for b, o in where]).reshape(1, ctx, kv_heads * d)
        qs = q[at : at + q_len].float()[None]
        outs.append(ops.attention(qs, k.float(), v.float(), heads, kv_heads, causal, window, scale)[0])
        at += q_len
    return torch.cat(outs)
