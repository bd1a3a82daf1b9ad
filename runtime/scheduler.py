"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget (max_num_batched_tokens) and a cap on running requests (max_num_seqs). The
running requests go first, highest priority (earliest arrival) first: decodes, then the next chunk of
prompts whose prefill did not fit one step; then waiting requests are admitted in arrival order while budget,
seats and blocks last, a prompt longer than the budget left being cut into a chunk (chunked prefill).

When a running request needs a block and none is free, the lowest-priority running request that has not been
scheduled this step is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue, keeping its generated tokens, so its next prefill covers prompt + output. With prefix
caching on, its freed full blocks usually survive in the cache and the recompute is mostly hits.

The static policy is the baseline for benchmarks: a batch is admitted only when nothing runs, and no request
joins until every member has finished.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache; this chunk is tokens [start, start + num_new)
    num_new: int
    sample: bool  # the chunk reaches the end of the known tokens, so its last row is sampled


@dataclass
class Schedule:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new == 1 and s.sample for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise KilnError(f"unknown scheduling policy {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in priority order
        self.num_preemptions = 0

    # ---- queue changes ------------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Take a running or waiting request out of the queues and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req.request_id)
        req.status = status

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        sched = Schedule()
        budget = self.max_num_batched_tokens
        done: set[str] = set()
        for decode in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                remaining = req.num_tokens - req.num_computed_tokens
                if req.request_id in done or remaining <= 0 or (remaining == 1) != decode:
                    i += 1
                    continue
                n = min(remaining, budget)
                if self._grow(req, n, i, done, sched, may_preempt_self=decode):
                    self._add(sched, req, n, done)
                    budget -= n
                    i += 1
                elif req.status is RequestStatus.RUNNING:
                    i += 1  # a prefill chunk that cannot grow waits for a later step
        if self.policy == "static":
            if not self.running:
                self._admit_static(sched, budget, done)
        else:
            self._admit(sched, budget, done)
        return sched

    def _grow(self, req: Request, n: int, index: int, done: set[str], sched: Schedule,
              may_preempt_self: bool) -> bool:
        """Make room for n more tokens of a running request, preempting lower-priority ones when needed."""
        while not self.bm.append_slots(req.request_id, req.num_computed_tokens + n):
            victims = [r for r in self.running[index + 1 :] if r.request_id not in done]
            if victims:
                victim = victims[-1]
            elif may_preempt_self:
                victim = req
            else:
                return False
            self.preempt(victim)
            sched.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, sched: Schedule, budget: int, done: set[str]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.bm.append_slots(req.request_id, req.num_computed_tokens + n):
                self._unmatch(req)
                break  # first come, first served: nobody overtakes the head of the queue
            self._start(req)
            self._add(sched, req, n, done)
            budget -= n

    def _admit_static(self, sched: Schedule, budget: int, done: set[str]) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._match_prefix(req)
            if not self.bm.append_slots(req.request_id, req.num_tokens):  # the batch reserves whole prompts
                self._unmatch(req)
                break
            self._start(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 0:
                self._add(sched, req, n, done)
                budget -= n

    def _match_prefix(self, req: Request) -> None:
        req.num_computed_tokens = self.bm.match_prefix(req.request_id, req.all_token_ids)

    def _unmatch(self, req: Request) -> None:
        self.bm.free(req.request_id)
        req.num_computed_tokens = 0

    def _start(self, req: Request) -> None:
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.metrics.num_cached_tokens += req.num_computed_tokens
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.perf_counter()
        bisect.insort(self.running, req, key=lambda r: r.priority)

    @staticmethod
    def _add(sched: Schedule, req: Request, n: int, done: set[str]) -> None:
        start = req.num_computed_tokens
        sched.seqs.append(ScheduledSeq(req, start, n, start + n == req.num_tokens))
        done.add(req.request_id)
