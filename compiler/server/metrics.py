"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.runtime.engine import EngineStats

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

__all__ = ["CONTENT_TYPE", "ServerMetrics"]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=["model_name"], registry=r).labels(**label)

        self.running = gauge("kiln_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("kiln_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_used = gauge("kiln_kv_blocks_used", "KV cache blocks held by requests")
        self.kv_total = gauge("kiln_kv_blocks_total", "Usable KV cache blocks in the pool")
        # The engine's stats are running totals; Prometheus counters take their increments (_advance).
        self.preemptions = Counter("kiln_num_preemptions", "Requests preempted (their KV recomputed)",
                                   labelnames=["model_name"], registry=r).labels(**label)
        # vLLM's prefix_cache_queries / prefix_cache_hits count tokens; kiln's prefix cache counts full blocks
        self.prefix_queries = Counter("kiln_prefix_cache_queries", "Full prompt KV blocks looked up in the prefix "
                                      "cache", labelnames=["model_name"], registry=r).labels(**label)
        self.prefix_hits = Counter("kiln_prefix_cache_hits", "Full prompt KV blocks found in the prefix cache "
                                   "(reused, not computed)", labelnames=["model_name"], registry=r).labels(**label)
        self.steps = Counter("kiln_engine_steps", "Engine steps run", labelnames=["model_name"], registry=r)
        self.steps = self.steps.labels(**label)
        self.prompt = Counter("kiln_prompt_tokens", "Prompt tokens of requests that were scheduled",
                              labelnames=["model_name"], registry=r).labels(**label)
        self.generated = Counter("kiln_generation_tokens", "Generated tokens", labelnames=["model_name"],
                                 registry=r).labels(**label)
        self.aborted = Counter("kiln_requests_aborted", "Requests aborted (client disconnects)",
                               labelnames=["model_name"], registry=r).labels(**label)
        self._finished = Counter("kiln_requests_finished", "Requests finished, by finish reason",
                                 labelnames=["model_name", "finish_reason"], registry=r)
        self._label = model_name
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time from arrival to the first token",
                              labelnames=["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self.itl = Histogram("kiln_inter_token_latency_seconds", "Time between a request's consecutive tokens",
                             labelnames=["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self.batch = Histogram("kiln_running_requests_per_step", "Running requests in each engine step",
                               labelnames=["model_name"], buckets=_BATCH, registry=r).labels(**label)
        self.max_batch = gauge("kiln_max_running_requests_per_step", "The largest running batch of any step")
        self.spec_proposed = Counter("kiln_spec_draft_tokens_proposed", "Speculative draft tokens proposed",
                                     labelnames=["model_name"], registry=r).labels(**label)
        self.spec_accepted = Counter("kiln_spec_draft_tokens_accepted", "Speculative draft tokens accepted",
                                     labelnames=["model_name"], registry=r).labels(**label)
        self.spec_mean_len = gauge("kiln_spec_mean_accepted_length",
                                   "Tokens emitted per speculative decode per step (1: no draft accepted)")
        self._max = 0
        self._totals: dict[str, int] = {}

    def engine_stats(self, st: EngineStats) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_used.set(st.num_blocks - st.num_free_blocks)
        self.kv_total.set(st.num_blocks)
        self._advance("preemptions", self.preemptions, st.num_preemptions)
        self._advance("prefix_queries", self.prefix_queries, st.prefix_cache_queries)
        self._advance("prefix_hits", self.prefix_hits, st.prefix_cache_hits)
        self._advance("spec_proposed", self.spec_proposed, st.spec_proposed)
        self._advance("spec_accepted", self.spec_accepted, st.spec_accepted)
        self.spec_mean_len.set(st.mean_accepted_length)

    def _advance(self, name: str, counter, total: int) -> None:
        """Add what a running total of the engine gained since the last stats to its counter."""
        last = self._totals.get(name, 0)
        if total > last:
            counter.inc(total - last)
        self._totals[name] = max(total, last)

    def step(self, num_running: int) -> None:
        self.steps.inc()
        self.batch.observe(num_running)
        if num_running > self._max:
            self._max = num_running
            self.max_batch.set(num_running)

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._label, finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
