"""Warm-up: compile every kernel variant while the model loads, not on the first request (issue 9).

Triton compiles a kernel per integer specialization (a value of 1, a multiple of 16, anything else) of its
arguments, so the warm-up runs one step per shape that a real step can hit: prefill and decode, token and sample
counts of 1, odd and a multiple of 16, short and long contexts (one and several decode splits), and verification
chunks when speculating. The steps run on dummy batches that only touch the null block (the block padding rows
use), so the cache holds nothing that a request could read.
"""

from __future__ import annotations

import sys

import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.step import KVCache, StepBatch, StepModel


def warmup_shapes(max_model_len: int, verify_len: int = 0) -> list[tuple[int, int, int]]:
    """(sequences, new tokens each, context) of the warm-up steps; verify_len: a verification chunk's query rows
    (k + 1) when speculating, else 0."""
    long_ctx = min(max_model_len, 1024)
    shapes = [(1, 7, 7), (1, 16, 16), (2, 9, 40), (1, 1, 1), (3, 1, long_ctx), (16, 1, 17)]
    if verify_len:
        shapes.append((3, verify_len, 40))
    return [(s, min(q, min(c, max_model_len)), min(c, max_model_len)) for s, q, c in shapes]


def warmup(model: StepModel, kv_cache: KVCache, shapes: list[tuple[int, int, int]], block_size: int,
           num_routed: int = 0, progress: bool = True) -> None:
    """One step of `model` per shape, with a progress bar; on CUDA, waits for them to finish."""
    from tqdm import tqdm  # lazy: only an engine that warms up needs it

    with torch.inference_mode():
        for shape in tqdm(shapes, desc="kiln: compiling kernels", unit="step", file=sys.stderr,
                          disable=not progress):
            model(null_batch(model.device, block_size, num_routed, *shape), kv_cache)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def null_batch(dev: torch.device, bs: int, num_routed: int, num_seqs: int, q_len: int, ctx: int) -> StepBatch:
    """num_seqs sequences of q_len new tokens at the end of a ctx-token context, every block the null block."""
    n = num_seqs * q_len
    positions = torch.arange(ctx - q_len, ctx, device=dev).repeat(num_seqs)
    qsl = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
    routed = {}
    if num_routed:  # every routed layer starts empty and writes (at most q_len entries) to its null block
        routed = dict(routed_lens=torch.zeros(num_routed, num_seqs, dtype=torch.int32, device=dev),
                      routed_block_tables=torch.full((num_routed, num_seqs, -(-q_len // bs)), NULL_BLOCK,
                                                     dtype=torch.int32, device=dev))
    return StepBatch(
        tokens=torch.zeros(n, dtype=torch.int64, device=dev), positions=positions,
        slot_mapping=NULL_BLOCK * bs + positions % bs,
        block_tables=torch.full((num_seqs, -(-ctx // bs)), NULL_BLOCK, dtype=torch.int32, device=dev),
        context_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev), query_start_loc=qsl,
        sample_indices=(qsl[1:] - 1).long(), max_query_len=q_len, max_context_len=ctx, **routed,
    )  # fmt: skip
