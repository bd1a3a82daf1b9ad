"""The one interface between the runtime and a compiled model: a step over a flat batch of tokens.

The scheduler picks, for each running sequence, a chunk of new tokens (a prefill chunk, or one decode
token); the model runner flattens them into a StepBatch; the compiled step model writes each new token's
K/V into its cache slot, attends over the sequence's blocks, and returns logits only for the rows that are
sampled. Prefill chunks and decodes mix freely in one step.

Cache layout: one tensor [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim] in the model's
kv_dtype. Slot s of the pool is block s // block_size, offset s % block_size. An int8 cache (kv_dtype int8)
comes with fp32 scales [layers, 2, num_blocks, block_size, kv_heads], one per cached token and kv head; both
travel together as a KVCache, which the runtime allocates once and only passes through.

Mixture-of-Depths (a model with num_routed_layers > 0): `layers` counts the dense attention layers only; the
routed layers have a pool of their own, KVCache.routed [num_routed_layers, 2, routed_blocks, block_size, kv_heads,
head_dim], with one block table per (sequence, routed layer) holding only that layer's routed tokens. A step then
also takes, per routed layer and sequence, its routed length before the step (StepBatch.routed_lens) and its
block table (StepBatch.routed_block_tables), and returns, besides the logits, which of the new tokens each routed
layer routed (so the host can advance the routed lengths, give back unused blocks and record a routed layer's
state at each block boundary for prefix caching).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kiln.model_config import KV_BLOCK_MAX  # noqa: F401  (part of the contract: the runtime checks block sizes)


class TokenizerLike(Protocol):
    """What the runtime needs of a tokenizer (kiln.tokenizer.Tokenizer is one)."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ModelLimits(Protocol):
    """What the runtime needs of a model's configuration (kiln.model_config.ModelConfig is one)."""

    context: int  # the longest sequence the model takes, prompt and output together


# The step graph's cache inputs (after StepBatch's tensors, step_input_names): the pool, an int8 pool's scales, and
# the routed layers' pool. The paged op's own parameters of the same names are kiln.ir.signatures' (PAGED_STEP).
KV_CACHE, KV_SCALES, ROUTED_KV_CACHE = "kv_cache", "kv_scales", "routed_kv_cache"


@dataclass(frozen=True)
class StepInput:
    """What a StepBatch field is to the step graph: the one description of each input, which the kv_cache pass's
    example inputs and graph_inputs read (and tests tie the runtime's staging layout and the paged op to).

    dtype: the tensor's element type, None for a host-side int. shape: its sizes in symbols, N new tokens, S
    sequences, R sampled rows, W blocks per sequence, C the tokens W blocks hold, L routed layers, WR routed blocks
    per sequence ("S+1": one more than S); a host int's shape is the one symbol it bounds (its example value is
    that size). flat: the Level-1 graph's per-token inputs, which the step graph takes as [1, *shape]. routed:
    Mixture-of-Depths models only (None otherwise, and no placeholder in a dense model's graph).
    """

    dtype: torch.dtype | None
    shape: tuple[str, ...]
    flat: bool = False
    routed: bool = False

    def example(self, sizes: Mapping[str, int]) -> tuple[int, ...] | int:
        """The graph's shape for these symbol sizes (a host int: the size it bounds)."""
        dims = tuple(sizes[d.removesuffix("+1")] + d.endswith("+1") for d in self.shape)
        if self.dtype is None:
            return dims[0]
        return (1, *dims) if self.flat else dims


def _input(dtype: torch.dtype | None, *shape: str, flat: bool = False, routed: bool = False) -> Any:
    """A StepBatch field with its StepInput (routed ones default to None)."""
    extra = {"default": None} if routed else {}
    return field(metadata={"step_input": StepInput(dtype, shape, flat, routed)}, **extra)


@dataclass
class StepBatch:
    tokens: torch.Tensor = _input(torch.int64, "N", flat=True)  # every scheduled sequence's new tokens, concatenated
    positions: torch.Tensor = _input(torch.int64, "N", flat=True)  # each new token's position in its sequence
    slot_mapping: torch.Tensor = _input(torch.int64, "N")  # cache slot each new token's K/V is written to
    block_tables: torch.Tensor = _input(torch.int32, "S", "W")  # each sequence's blocks in order (padding: 0)
    context_lens: torch.Tensor = _input(torch.int32, "S")  # tokens in the cache for each sequence after this step
    query_start_loc: torch.Tensor = _input(torch.int32, "S+1")  # sequence i's new tokens: rows [q[i], q[i + 1])
    sample_indices: torch.Tensor = _input(torch.int64, "R")  # rows of N whose logits are returned, in this order
    # Host-side copies so kernels need no device -> host sync: a bound on every sequence's new tokens, on its context.
    max_query_len: int = _input(None, "N")
    max_context_len: int = _input(None, "C")
    # Mixture-of-Depths models only (None otherwise): per routed layer and sequence, the routed length before the
    # step and that layer's block table (padding: 0, the null block).
    routed_lens: torch.Tensor | None = _input(torch.int32, "L", "S", routed=True)
    routed_block_tables: torch.Tensor | None = _input(torch.int32, "L", "S", "WR", routed=True)

    def graph_inputs(self, cache: KVCache) -> dict[str, object]:
        """The step graph's inputs by name, in step_input_names order (the flat ones as [1, N])."""
        values: dict[str, object] = {KV_CACHE: cache.data, KV_SCALES: cache.scales, ROUTED_KV_CACHE: cache.routed}
        for name, spec in STEP_INPUTS.items():
            value = getattr(self, name)
            values[name] = value.view(1, -1) if spec.flat else value
        return {name: values[name] for name in step_input_names(cache.scales is not None, cache.routed is not None)}

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


# StepBatch's fields in order, each with what it is (a field without a StepInput fails here, at import).
STEP_INPUTS: dict[str, StepInput] = {f.name: f.metadata["step_input"] for f in dataclasses.fields(StepBatch)}


@dataclass
class KVCache:
    """The paged KV pool: `data` in the model's kv_dtype, plus the per-token-and-head scales of an int8 cache."""

    data: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    scales: torch.Tensor | None = None  # fp32 [layers, 2, num_blocks, block_size, kv_heads] when data is int8
    routed: torch.Tensor | None = None  # Mixture-of-Depths: [routed_layers, 2, routed_blocks, block_size, ...]

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[3])


@dataclass
class VerifyBatch:
    """Speculative decoding's verification of B rows at once (the modified rejection sampler).

    Row b proposed num_drafts[b] <= K tokens d_1..d_n; the target scored its last token and the drafts in one
    chunk, giving target_probs[b, j] = p(. | prefix, d_1..d_j) for j = 0..K (processed: temperature, top-k, top-p
    and min-p applied, the same way as to draft_probs). d_j is accepted while uniforms[b, j - 1] < p(d_j) / q(d_j);
    at the first rejection j the row's next token is drawn from max(0, p_{j-1} - q_j) renormalized, and when all n
    pass, a bonus token from p_n. q is draft_probs (None: drafts are deterministic, q is one-hot on d_j). The one
    draw per row is an exponential race, argmax(dist / noise[b]), so it needs no sort or cumulative sum.
    """

    target_probs: torch.Tensor  # fp32 [B, K + 1, V]
    draft_tokens: torch.Tensor  # int64 [B, K] (entries past num_drafts[b] are ignored)
    draft_probs: torch.Tensor | None  # fp32 [B, K, V], or None for deterministic drafters (n-gram)
    num_drafts: torch.Tensor  # int32 [B]
    uniforms: torch.Tensor  # fp32 [B, K]: U[0, 1) draws for the acceptance tests
    noise: torch.Tensor  # fp32 [B, V]: Exp(1) draws (> 0) for the row's final draw


class Verifier(Protocol):
    """kiln::spec_verify or its kernel: (num_accepted int32 [B], next_token int64 [B]) for a VerifyBatch. A compiled
    step model carries one as `verify`."""

    def __call__(self, batch: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


@functools.cache
def step_input_names(quantized: bool, routed: bool = False) -> tuple[str, ...]:
    """The step graph's placeholders in order: StepBatch's tensors (the routed ones only for a routed model), the
    cache (and its scales when int8, the routed layers' pool when routed), then StepBatch's host-side ints.
    StepBatch is the one source; the kv_cache pass and CompiledStep both use this."""
    tensors = [n for n, s in STEP_INPUTS.items() if s.dtype is not None and (routed or not s.routed)]
    ints = [n for n, s in STEP_INPUTS.items() if s.dtype is None]
    caches = (KV_CACHE, *((KV_SCALES,) if quantized else ()), *((ROUTED_KV_CACHE,) if routed else ()))
    return (*tensors, *caches, *ints)


class StepModel(Protocol):
    """What the model runner calls. Built by kiln.compile.driver.compile_step (the kv_cache pass and its kernels)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype: torch.dtype  # of the weights and activations
    kv_dtype: torch.dtype  # of the KV cache: dtype, or torch.int8 (with scales)
    device: torch.device
    # Optional: `block_size`, the pool block size the compile config asks for (the engine's default), and
    # `verify`, a Verifier for speculative decoding (compiled with the model: its kernel or the reference op).
    # Mixture-of-Depths: `num_routed_layers` (> 0; num_layers then counts the dense layers only) and
    # `routed_capacity` (the share of tokens a routed layer is expected to keep, for sizing its pool).

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Logits [R, vocab] for batch.sample_indices, in the model's dtype or fp32 (the runner takes the rows it
        samples to fp32); writes the new tokens' K/V into kv_cache. A routed model returns (logits, routed int32
        [num_routed_layers, N]): 1 where a routed layer routed that row of the flat batch (and so wrote its K/V into
        that layer's own cache)."""
        ...


def kv_cache_shape(model: StepModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)


def num_routed_layers(model: StepModel) -> int:
    """How many routed (Mixture-of-Depths) layers the model has: their K/V live in a pool of their own."""
    return int(getattr(model, "num_routed_layers", 0) or 0)


def allocate_kv_cache(model: StepModel, num_blocks: int, block_size: int,
                      routed_num_blocks: int | None = None) -> KVCache:
    """A zeroed pool on the model's device in its kv_dtype (and fp32 scales for an int8 cache); a routed model's
    routed layers get their own pool of routed_num_blocks blocks each (default num_blocks)."""
    shape = kv_cache_shape(model, num_blocks, block_size)
    data = torch.zeros(shape, dtype=model.kv_dtype, device=model.device)
    scales = torch.zeros(shape[:-1], dtype=torch.float32, device=model.device) if model.kv_dtype == torch.int8 else None
    routed = None
    if num_routed_layers(model):
        nb = num_blocks if routed_num_blocks is None else routed_num_blocks
        routed = torch.zeros((num_routed_layers(model), *shape[1:2], nb, *shape[3:]), dtype=model.kv_dtype,
                             device=model.device)
    return KVCache(data, scales, routed)


def kv_bytes_per_layer_block(model: StepModel, block_size: int) -> int:
    """Bytes one block of one layer takes, k and v: head_dim values per token and kv head, plus an fp32 scale when
    the cache is int8."""
    row = model.head_dim * model.kv_dtype.itemsize + (4 if model.kv_dtype == torch.int8 else 0)
    return 2 * block_size * model.num_kv_heads * row


def kv_bytes_per_block(model: StepModel, block_size: int) -> int:
    """Bytes one block of the (dense) pool takes over all its layers."""
    return model.num_layers * kv_bytes_per_layer_block(model, block_size)
