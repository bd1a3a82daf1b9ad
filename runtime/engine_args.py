"""The Engine's constructor arguments, checked before anything is allocated: each mistake is a KilnError that
names the argument, the allowed values and, where there is one, the flag to change."""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.step import KV_BLOCK_MAX, ModelLimits, StepModel, num_routed_layers


def _check_count(name: str, value: object, optional: bool) -> None:
    """KilnError unless value is an integer >= 1 (or None when optional)."""
    if value is None and optional:
        return
    allowed = "an integer >= 1" + (" (or unset)" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise KilnError(f"{name} = {value!r} must be an integer, not {type(value).__name__}; allowed: {allowed}")
    if value < 1:
        raise KilnError(f"{name} = {value!r} is out of range; allowed: {allowed}")


def check_engine_args(
    step_model: StepModel,
    cfg: ModelLimits,
    drafter: object | None,
    *,
    max_num_seqs: object,
    max_num_batched_tokens: object,
    num_blocks: object,
    block_size: object,
    max_model_len: object,
    gpu_memory_utilization: object,
    speculation_max_batch: object,
    flags: dict[str, object],
) -> int:
    """Check the arguments; return the KV block size (None: the compile config's `kv_cache = paged(block = ...)`,
    which the step model carries, else 16). flags: the True / False / None switches by name."""
    for name, value, optional in (("max_num_seqs", max_num_seqs, False),
                                  ("max_num_batched_tokens", max_num_batched_tokens, False),
                                  ("num_blocks", num_blocks, True), ("block_size", block_size, True),
                                  ("max_model_len", max_model_len, True)):
        _check_count(name, value, optional)
    if max_model_len is not None and max_model_len > cfg.context:
        raise KilnError(f"max_model_len = {max_model_len} is longer than the model's context of {cfg.context} "
                        f"tokens (its positions end there); allowed: 1 .. {cfg.context}, or unset")
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise KilnError(f"{name} = {value!r} must be True, False or None, not {type(value).__name__}")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise KilnError(f"gpu_memory_utilization = {gpu_memory_utilization!r} must be a number in (0, 1], not "
                        f"{type(gpu_memory_utilization).__name__}")
    if block_size is None:
        block_size = getattr(step_model, "block_size", 16)
    if not (1 <= block_size <= KV_BLOCK_MAX and block_size & (block_size - 1) == 0):
        raise KilnError(f"block_size = {block_size}: a KV cache block must hold a power of two from 1 to "
                        f"{KV_BLOCK_MAX} tokens (the attention kernels' key tiles cover whole blocks); "
                        "use block_size 16 (--block-size 16)")
    if drafter is not None and getattr(step_model, "verify", None) is None:
        raise KilnError("speculative decoding needs a verifier, but this step model has no `verify`; compile it "
                        "with speculation (compile key `speculation`, or --speculation / LLM(speculation=...))")
    if speculation_max_batch is not None and not (isinstance(speculation_max_batch, int)
                                                  and speculation_max_batch >= 0):
        raise KilnError(f"speculation_max_batch = {speculation_max_batch!r} is out of range; allowed: an "
                        "integer >= 0 (0 turns speculation off) or None for the measured default")
    if num_routed_layers(step_model) and drafter is not None:
        raise KilnError("speculative decoding is not built for Mixture-of-Depths models (its rejected drafts would "
                        "have to be taken back out of every routed layer's cache); serve this model with "
                        "speculation off (--speculation off, LLM(speculation='off'))")
    return block_size
