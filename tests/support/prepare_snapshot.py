"""ModelRunner.prepare() on its decode fast path and on the general path, as comparable snapshots."""

from __future__ import annotations

import kiln.runtime.model_runner as runner_mod
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.schedule import Schedule

DENSE = ("tokens", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc", "sample_indices")
ROUTED = (*DENSE, "routed_lens", "routed_block_tables")


def snapshot(runner: ModelRunner, sched: Schedule, general: bool, names: tuple[str, ...] = DENSE) -> tuple:
    """prepare(sched)'s padding, bounds and every named field (dtype and values); general=True makes the fast
    path's gather_decodes decline, so the general path builds the batch. Fails if prepare never tried the fast
    path (the comparison would then compare the general path with itself)."""
    calls = []
    real = runner_mod.gather_decodes

    def gather(*a, **k):
        calls.append(1)
        return None if general else real(*a, **k)

    runner_mod.gather_decodes = gather
    try:
        batch, padded = runner.prepare(sched)
    finally:
        runner_mod.gather_decodes = real
    assert calls, "prepare did not try the fast path"
    return (padded, batch.max_query_len, batch.max_context_len,
            *((getattr(batch, n).dtype, getattr(batch, n).tolist()) for n in names))
