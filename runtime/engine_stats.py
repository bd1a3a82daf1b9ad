"""What the engine counts: EngineStats (a snapshot, Engine.stats) and the speculative counters it is built from."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.scheduler import Scheduler


@dataclass
class SpecCounters:
    """Speculative decoding, summed over the engine's life."""

    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # steps that verified drafts
    rows: int = 0  # speculative decodes verified (rows of VerifyBatches)
    emitted: int = 0  # tokens those rows emitted (accepted drafts + the next token)
    drafter_failures: int = 0  # steps whose drafter raised (they decoded without drafts)


@dataclass
class EngineStats:
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # of those, reused
    prefix_cache_evictions: int
    num_shared_blocks: int  # blocks referenced by more than one request right now
    num_free_blocks: int
    num_blocks: int  # usable blocks in the pool (the null block excluded)
    kv_waste_slots: int  # allocated minus used slots over the running requests
    num_running: int
    num_waiting: int
    num_batched_tokens: int  # rows run through the model (prefill, recompute and decode)
    num_generated_tokens: int
    spec_proposed: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # of those, accepted
    spec_verify_steps: int = 0  # steps that verified drafts
    spec_rows: int = 0  # speculative decodes verified (rows of VerifyBatches)
    spec_emitted: int = 0  # tokens those rows emitted (accepted drafts + the next token)
    spec_off_steps: int = 0  # steps where speculation was off because more than speculation_max_batch decodes ran
    spec_drafter_failures: int = 0  # steps whose drafter raised (they decoded without drafts)
    kv_bytes: int = 0  # the KV pools' size (a routed model's routed pools included)
    kv_bytes_dense: int = 0  # what the same pool would take if every layer cached every token
    routed_blocks: int = 0  # usable blocks in each routed layer's pool (0: not a routed model)
    routed_blocks_in_use: tuple[int, ...] = ()  # per routed layer, right now
    num_steps_ahead: int = 0  # steps launched before the previous step's sampled ids were read (async scheduling)

    @property
    def kv_bytes_saved(self) -> int:
        return self.kv_bytes_dense - self.kv_bytes

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative decode per step (1 = no draft accepted)."""
        return self.spec_emitted / self.spec_rows if self.spec_rows else 0.0

    def as_dict(self) -> dict:
        """Every field and derived figure (the server's /metrics and the benchmarks' JSON)."""
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "kv_bytes_saved": self.kv_bytes_saved}


def kv_waste(bm: BlockManager, sch: Scheduler, writing: Mapping[str, int] | None = None) -> list[int]:
    """Allocated minus used (K/V written) slots of each running request; `writing`: the tokens a step in flight
    (async scheduling) writes for each request, counted as used."""
    writing = writing or {}
    return [bm.num_slots(r.request_id) - r.num_computed_tokens - writing.get(r.request_id, 0) for r in sch.running]


def collect_stats(bm: BlockManager, sch: Scheduler, spec: SpecCounters, *, num_steps: int, num_batched_tokens: int,
                  num_generated_tokens: int, kv_bytes: int, kv_bytes_dense: int, num_steps_ahead: int = 0,
                  writing: Mapping[str, int] | None = None) -> EngineStats:
    """A snapshot of the engine's counters and of its block manager and scheduler right now (writing: as for
    kv_waste)."""
    routed = isinstance(bm, RoutedBlockManager)
    return EngineStats(
        num_steps=num_steps, num_preemptions=sch.num_preemptions,
        prefix_cache_queries=bm.stats.prefix_queries, prefix_cache_hits=bm.stats.prefix_hits,
        prefix_cache_evictions=bm.stats.evictions, num_shared_blocks=bm.num_shared_blocks(),
        num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_usable_blocks,
        kv_waste_slots=sum(kv_waste(bm, sch, writing)),
        num_running=len(sch.running), num_waiting=len(sch.waiting),
        num_batched_tokens=num_batched_tokens, num_generated_tokens=num_generated_tokens,
        spec_proposed=spec.proposed, spec_accepted=spec.accepted, spec_verify_steps=spec.verify_steps,
        spec_rows=spec.rows, spec_emitted=spec.emitted, spec_off_steps=sch.num_spec_off_steps,
        spec_drafter_failures=spec.drafter_failures, kv_bytes=kv_bytes, kv_bytes_dense=kv_bytes_dense,
        routed_blocks=bm.routed[0].num_usable_blocks if routed and bm.routed else 0,
        routed_blocks_in_use=tuple(bm.routed_blocks_in_use()) if routed else (), num_steps_ahead=num_steps_ahead,
    )  # fmt: skip
