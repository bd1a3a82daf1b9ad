"""The scheduler's queues (runtime/scheduler.py's Scheduler is a SchedulerQueues): its settings, the waiting queue in
arrival order and the running list in priority order, what changes them (add, finish, preempt by recompute) and
admission, waiting requests taken into the step in arrival order while budget, seats and blocks last (a prompt's
cached prefix matched first; the static policy's batches reserve whole prompts)."""

from __future__ import annotations

import bisect
import time
from collections import deque

from kiln.errors import KilnError
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.schedule import Schedule, ScheduledSeq


class SchedulerQueues:
    """The scheduler's settings, its queues and admission (see the module docstring)."""

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
        self.spec_k = 0  # draft slots per speculative decode (0: speculation off)
        # A draft model with a shorter context than the target's (ModelDrafter.context): a decode at position p gets
        # at most spec_context - p draft slots, since the drafter makes no draft past it (None: no bound)
        self.spec_context: int | None = None
        self.spec_max_batch: int | None = None  # speculate only while this many decodes run or fewer (None: always)
        self.num_spec_off_steps = 0  # steps that had speculative candidates but too many decodes to speculate

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

    # ---- admission -----------------------------------------------------------------------------------------

    def _admit(self, sched: Schedule, budget: int, done: set[str], seats: int | None = None,
               whole: bool = False) -> None:
        """Waiting requests into the step in arrival order while budget, seats (None: those running requests
        leave) and blocks last; whole: only with their whole prompts (no chunk cut at the budget)."""
        seats = self.max_num_seqs - len(self.running) if seats is None else seats
        while self.waiting and budget > 0 and seats > 0:
            req = self.waiting[0]
            if whole and req.unscored_from is not None:
                break  # ahead of a step in flight: its prompt logprobs wait for a step scheduled from the host
            self._match_prefix(req)
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            if (whole and n < need) or not self.bm.append_slots(req.request_id, req.num_computed_tokens + n):
                self._unmatch(req)
                break  # first come, first served: nobody overtakes the head of the queue
            self._start(req)
            self._add(sched, req, n, done)
            budget -= n
            seats -= 1

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
        req.num_computed_tokens = self.bm.match_prefix(req.request_id, req.prefix_cache_tokens())

    def _unmatch(self, req: Request) -> None:
        self.bm.free(req.request_id)
        req.num_computed_tokens = 0

    def _start(self, req: Request) -> None:
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        if req.metrics.first_scheduled_time is None:
            # vLLM's num_cached_tokens: the prompt tokens the first admission found cached; a re-admission after
            # preemption (which finds the request's own blocks, outputs included) leaves it as it was
            req.metrics.num_cached_tokens = req.num_computed_tokens
            req.metrics.first_scheduled_time = time.perf_counter()
        bisect.insort(self.running, req, key=lambda r: r.priority)

    @staticmethod
    def _add(sched: Schedule, req: Request, n: int, done: set[str], drafts: int = 0) -> None:
        start = req.num_computed_tokens
        sched.seqs.append(ScheduledSeq(req, start, n + drafts, start + n == req.num_tokens, drafts))
        done.add(req.request_id)
