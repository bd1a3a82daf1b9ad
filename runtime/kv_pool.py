"""How many KV blocks the pool gets: explicit, from free GPU memory, or a CPU default; refused when too small.

A Mixture-of-Depths model's routed layers have pools of their own (kiln.step.KVCache.routed), each sized at the
model's routed capacity times the dense pool (routed_pool_blocks) but never below one full-length sequence: a
routed layer holds only its routed tokens. Their cost per dense block (routed_bytes_per_block) is added to the
dense block's when the pool is sized from memory, so both fit the budget together.
"""

from __future__ import annotations

import math

import torch

from kiln.errors import KilnError
from kiln.step import StepModel, kv_bytes_per_block, kv_bytes_per_layer_block, num_routed_layers

CPU_KV_BYTES = 1 << 30  # the CPU default pool stops growing at 1 GiB (but always holds one full-context sequence)


class PoolTooSmallError(KilnError):
    """choose_num_blocks' refusal: the pool cannot hold one sequence of the longest allowed length. Its message gives
    the fix as LLM's arguments; an entry point that spells them otherwise (the CLI's flags) rewords it (advised)."""

    def __init__(self, facts: str, *, need: int, usable_tokens: int, from_memory: bool, advice: str | None = None):
        self.facts, self.need, self.usable_tokens, self.from_memory = facts, need, usable_tokens, from_memory
        if advice is None:
            names = "gpu_memory_utilization" if from_memory else "num_blocks"
            advice = self._grow("num_blocks", "gpu_memory_utilization") + ", or lower max_model_len " \
                f"(LLM({names}=..., max_model_len=...))"
        super().__init__(f"{facts}; {advice}")

    def _grow(self, num_blocks: str, gpu_memory_utilization: str) -> str:
        # only the setting the pool was sized from: with num_blocks given, gpu_memory_utilization changes nothing
        if self.from_memory:
            return f"raise {gpu_memory_utilization} (or free GPU memory)"
        return f"raise {num_blocks} to at least {self.need}"

    def advised(self, num_blocks: str, gpu_memory_utilization: str, shorten: str | None) -> PoolTooSmallError:
        """This error with its fix in an entry point's words: its names of the two pool settings, and how it makes
        the longest sequence shorter (None: it cannot)."""
        advice = self._grow(num_blocks, gpu_memory_utilization) + (f", or {shorten}" if shorten else "")
        return PoolTooSmallError(self.facts, need=self.need, usable_tokens=self.usable_tokens,
                                 from_memory=self.from_memory, advice=advice)


def choose_num_blocks(model: StepModel, context: int, *, block_size: int, num_blocks: int | None = None,
                      gpu_memory_utilization: float = 0.9, max_num_seqs: int = 64,
                      extra_bytes_per_block: int = 0) -> int:
    """Blocks in the pool, block 0 (the null block) included.

    extra_bytes_per_block: what each block costs besides the model's own KV (a draft model's pool, which has one
    block for each of the target's), so the two pools together fit the budget.

    CUDA: what fits in `gpu_memory_utilization` of the device's memory after what is already used (weights,
    other processes). CPU: room for max_num_seqs full-context sequences, capped at CPU_KV_BYTES.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise KilnError(f"block_size = {block_size!r} is out of range; allowed: an integer >= 1 (16 is usual)")
    if not 0 < gpu_memory_utilization <= 1:
        raise KilnError(f"gpu_memory_utilization = {gpu_memory_utilization!r} is out of range; allowed: (0, 1]")
    per_block = kv_bytes_per_block(model, block_size) + extra_bytes_per_block
    per_seq = -(-context // block_size)
    need = per_seq + 1
    if num_blocks is not None:
        n, source = int(num_blocks), f"num_blocks {num_blocks}"
    elif model.device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator holds unused (weight loading's) count as taken
        free, total = torch.cuda.mem_get_info(model.device)
        budget = free - (1 - gpu_memory_utilization) * total
        n = max(int(budget // per_block), 0)
        source = (f"gpu_memory_utilization {gpu_memory_utilization} ({free / 2**30:.2f} GiB free of "
                  f"{total / 2**30:.2f} GiB)")
    else:
        cap = max(CPU_KV_BYTES // per_block, per_seq)
        n, source = min(max_num_seqs * per_seq, cap) + 1, "the CPU default"
    if n < need:
        raise PoolTooSmallError(
            f"the KV cache pool would have {n} block{'s' * (n != 1)} of {block_size} tokens "
            f"({n * per_block / 2**20:.1f} MiB, "
            f"from {source}), but one sequence of the longest allowed length ({context} tokens) needs {per_seq} "
            f"blocks plus the reserved null block = {need} ({need * per_block / 2**20:.1f} MiB)",
            need=need, usable_tokens=max(n - 1, 0) * block_size, from_memory=num_blocks is None)
    return n


def routed_bytes_per_block(model: StepModel, block_size: int) -> int:
    """What the routed layers' pools cost per block of the dense pool, sized at the routed capacity (0 for a dense
    model)."""
    share = float(getattr(model, "routed_capacity", 1.0))
    return math.ceil(num_routed_layers(model) * share * kv_bytes_per_layer_block(model, block_size))


def routed_pool_blocks(model: StepModel, dense_blocks: int, context: int, *, block_size: int,
                       routed_num_blocks: int | None = None) -> int:
    """Blocks in each routed layer's pool, its null block included: routed_num_blocks when given, else the routed
    capacity's share of the dense pool; never fewer than one sequence of `context` tokens needs."""
    per_seq = -(-context // block_size)
    if routed_num_blocks is None:
        share = float(getattr(model, "routed_capacity", 1.0))
        return max(math.ceil(share * (dense_blocks - 1)), per_seq) + 1
    if not isinstance(routed_num_blocks, int) or routed_num_blocks < per_seq + 1:
        raise KilnError(
            f"routed_num_blocks = {routed_num_blocks!r}: each routed layer's pool must hold one sequence of the "
            f"longest allowed length ({context} tokens = {per_seq} blocks of {block_size}) plus its null block; "
            f"give at least {per_seq + 1}, or leave it unset to size it from the routed capacity"
        )
    return routed_num_blocks
