"""The figures `kiln bench throughput` reports (runtime/throughput.py): exact values on known inputs, from a fake
engine and from the real engine over the fake step model, both on a fake clock."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.runtime import throughput
from kiln.runtime.engine import Engine
from kiln.runtime.request import RequestMetrics
from kiln.runtime.throughput import TraceRequest, _stats, run_trace
from tests.support.fake_step import FakeStepModel, fake_config


class FakeClock:
    """perf_counter that moves only when advanced; it starts far from 0 so that an absolute time is no latency."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_stats_of_a_known_list():
    xs = [float(x) for x in range(1, 102)]  # 1 .. 101: mean 51, median 51
    random.Random(0).shuffle(xs)  # the order they finish in is not the order of their values
    assert _stats(xs) == {"mean": 51.0, "p50": 51.0, "p99": 100.0}  # p99: the value at index round(0.99 * 100)
    assert _stats([2.0, 9.0, 4.0]) == {"mean": 5.0, "p50": 4.0, "p99": 9.0}
    assert _stats([7.5]) == {"mean": 7.5, "p50": 7.5, "p99": 7.5}
    assert _stats([]) == {"mean": 0.0, "p50": 0.0, "p99": 0.0}


@pytest.mark.parametrize("n", [1, 2, 5, 10, 99, 100, 257])
def test_stats_percentiles_are_numpys_nearest(n):
    xs = np.random.default_rng(n).exponential(size=n).tolist()
    s = _stats(xs)
    assert s["mean"] == pytest.approx(float(np.mean(xs)), rel=1e-12)
    assert s["p50"] == float(np.percentile(xs, 50, method="nearest"))
    assert s["p99"] == float(np.percentile(xs, 99, method="nearest"))


class FakeEngine:
    """Admits requests in arrival order into `seats` seats; each step takes the next of `durations` seconds on the
    clock and gives every seated request one token. Outputs carry the engine's real RequestMetrics."""

    def __init__(self, clock: FakeClock, durations: list[float], seats: int):
        self.clock, self.durations, self.seats = clock, list(durations), seats
        self.waiting: list[SimpleNamespace] = []
        self.running: list[SimpleNamespace] = []
        self.ids: list[str] = []
        self.drafter = None
        self.stats = SimpleNamespace(num_steps=0, num_preemptions=3, prefix_cache_hits=5, num_batched_tokens=11)

    def add_request(self, *, prompt_token_ids, params, request_id):
        # what run_trace asks for: greedy outputs of exactly the trace's length
        assert params.temperature == 0 and params.ignore_eos and params.output_kind == "final_only"
        self.ids.append(request_id)
        self.waiting.append(SimpleNamespace(id=request_id, want=params.max_tokens, tokens=[],
                                            metrics=RequestMetrics(self.clock())))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[SimpleNamespace]:
        while self.waiting and len(self.running) < self.seats:
            self.running.append(self.waiting.pop(0))
        self.clock.now += self.durations.pop(0)
        self.stats.num_steps += 1
        out = []
        for r in self.running:
            r.tokens.append(len(r.tokens))
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = self.clock.now
            finished = len(r.tokens) == r.want
            if finished:
                r.metrics.finish_time = self.clock.now
            out.append(SimpleNamespace(request_id=r.id, finished=finished, metrics=r.metrics,
                                       outputs=[SimpleNamespace(token_ids=list(r.tokens))]))
        self.running = [r for r in self.running if len(r.tokens) < r.want]
        return out


TRACE = [TraceRequest([1, 2, 3], 1), TraceRequest([4] * 5, 2), TraceRequest([5, 6], 4)]


def test_run_trace_figures_on_a_fake_engine_and_clock(monkeypatch):
    clock = FakeClock(100.0)
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=clock))
    eng = FakeEngine(clock, [0.5, 1.0, 1.5, 2.0, 2.5], seats=2)
    said: list[str] = []
    r = run_trace(eng, TRACE, label="c-", progress=said.append, progress_every_s=2.0)
    assert eng.ids == ["c-0", "c-1", "c-2"] and not eng.durations  # five steps, the clock at 107.5
    # The clock after each step: 100.5, 101.5, 103, 105, 107.5. Request 0 (1 token) gets its token and finishes at
    # 100.5; request 1 (2 tokens) gets them at 100.5 and 101.5; request 2 takes request 0's seat at the second step
    # and gets its 4 tokens at 101.5, 103, 105 and 107.5.
    assert r["elapsed_s"] == 7.5
    assert r["requests_per_s"] == 3 / 7.5
    assert r["output_tokens_per_s"] == (1 + 2 + 4) / 7.5
    assert r["total_tokens_per_s"] == (3 + 5 + 2 + 1 + 2 + 4) / 7.5
    # TTFT from the start of the run: 0.5, 0.5, 1.5
    assert r["ttft_s"] == {"mean": pytest.approx(2.5 / 3, rel=1e-12), "p50": 0.5, "p99": 1.5}
    # TPOT over the tokens after the first: request 1 (101.5 - 100.5) / 1, request 2 (107.5 - 101.5) / 3; request
    # 0 has one token and no TPOT
    assert r["tpot_s"] == {"mean": 1.5, "p50": 1.0, "p99": 2.0}
    assert (r["steps"], r["preemptions"], r["prefix_cache_hits"], r["batched_tokens"]) == (5, 3, 5, 11)
    assert "speculation" not in r  # no drafter
    assert said == ["c: 2/3 requests done, 3.0 s", "c: 2/3 requests done, 5.0 s", "c: 3/3 requests done, 7.5 s"]
    assert 0 < r["ttft_s"]["p99"] <= r["elapsed_s"] and 0 < r["tpot_s"]["p99"] <= r["elapsed_s"]


class ClockedStepModel(FakeStepModel):
    """The fake step model, each call taking the next of `durations` seconds on the fake clock."""

    def __init__(self, clock: FakeClock, durations: list[float]):
        super().__init__()
        self.clock, self.durations = clock, list(durations)

    def __call__(self, batch, kv_cache):
        self.clock.now += self.durations.pop(0)
        return super().__call__(batch, kv_cache)


@pytest.mark.parametrize(("policy", "want"), [
    # step k takes k seconds. Continuous: step 1 prefills requests 0 and 1 (t = 1; request 0 is done), step 2
    # decodes request 1 (done) and prefills request 2 in the seat request 0 left (t = 3), steps 3-5 decode request
    # 2 (t = 6, 10, 15). TTFT 1, 1, 3; TPOT (3 - 1) / 1 and (15 - 3) / 3.
    ("continuous", {"elapsed_s": 15.0, "steps": 5, "ttft_s": {"mean": 5 / 3, "p50": 1.0, "p99": 3.0},
                    "tpot_s": {"mean": 3.0, "p50": 2.0, "p99": 4.0}}),
    # Static: request 2 waits until the whole first batch is done: step 2 decodes request 1 alone (t = 3), step 3
    # prefills request 2 (t = 6), steps 4-6 decode it (t = 10, 15, 21). TTFT 1, 1, 6; TPOT 2 and (21 - 6) / 3.
    ("static", {"elapsed_s": 21.0, "steps": 6, "ttft_s": {"mean": 8 / 3, "p50": 1.0, "p99": 6.0},
                "tpot_s": {"mean": 3.5, "p50": 2.0, "p99": 5.0}}),
])
def test_run_trace_figures_on_the_engine_with_a_fake_clock(monkeypatch, policy, want):
    """The engine stamps its requests' times and run_trace reads them against its own start: one clock."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)  # the engine's stamps and run_trace's
    model = ClockedStepModel(clock, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    eng = Engine(model, None, fake_config(64), block_size=4, max_num_seqs=2, scheduling_policy=policy)
    r = run_trace(eng, TRACE)
    assert model.calls == r["steps"] == want["steps"] and r["elapsed_s"] == want["elapsed_s"]
    for name in ("ttft_s", "tpot_s"):
        assert r[name] == pytest.approx(want[name], rel=1e-12), name
    assert r["requests_per_s"] == 3 / want["elapsed_s"] and r["output_tokens_per_s"] == 7 / want["elapsed_s"]
