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
from kiln.runtime.input_batch import input_shape
from kiln.step import STEP_INPUTS, KVCache, StepBatch, StepModel


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
    """num_seqs sequences of q_len new tokens at the end of a ctx-token context, every block the null block; each
    input in its StepInput's dtype and shape."""
    n = num_seqs * q_len
    sizes = {"N": n, "R": num_seqs, "S": num_seqs, "W": -(-ctx // bs), "L": num_routed, "WR": -(-q_len // bs)}

    def full(name: str, value: int) -> torch.Tensor:
        return torch.full(input_shape(name, sizes), value, device=dev)

    positions = torch.arange(ctx - q_len, ctx, device=dev).repeat(num_seqs)
    qsl = torch.arange(0, n + 1, q_len, device=dev)
    values = dict(tokens=full("tokens", 0), positions=positions, slot_mapping=NULL_BLOCK * bs + positions % bs,
                  block_tables=full("block_tables", NULL_BLOCK), context_lens=full("context_lens", ctx),
                  query_start_loc=qsl, sample_indices=qsl[1:] - 1)  # fmt: skip
    if num_routed:  # every routed layer starts empty and writes (at most q_len entries) to its null block
        values |= dict(routed_lens=full("routed_lens", 0), routed_block_tables=full("routed_block_tables", NULL_BLOCK))
    tensors = {name: t.to(STEP_INPUTS[name].dtype) for name, t in values.items()}
    return StepBatch(**tensors, max_query_len=q_len, max_context_len=ctx)
