"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget (max_num_batched_tokens) and a cap on running requests (max_num_seqs). The
running requests go first, highest priority (earliest arrival) first: decodes, then the next chunk of
prompts whose prefill did not fit one step; then waiting requests are admitted in arrival order while budget,
seats and blocks last, a prompt longer than the budget left being cut into a chunk (chunked prefill).

When a running request needs a block and none is free, the lowest-priority running request that has not been
scheduled this step is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue, keeping its generated tokens, so its next prefill covers prompt + output. With prefix
caching on, its freed full blocks usually survive in the cache and the recompute is mostly hits.

Speculative decoding (spec_k > 0, set by the engine when it has a drafter): a decode-ready request that may
speculate (Request.can_speculate) gets 1 + up to spec_k slots, its last token and the drafts, while the number
of decode-ready running requests is at most spec_max_batch. Drafts only use budget and blocks left over after
one token per decode, and never preempt anyone: they shrink (to none) when budget or free blocks run short.

The static policy is the baseline for benchmarks: a batch is admitted only when nothing runs, and no request
joins until every member has finished.

The queues, what changes them and admission are scheduler_queues.py's (Scheduler is a SchedulerQueues); what a
step runs, the Schedule this returns, is schedule.py's.
"""

from __future__ import annotations

from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.runtime.scheduler_queues import SchedulerQueues


class Scheduler(SchedulerQueues):
    """Which chunks run each step (see the module docstring); the constructor, the queues and admission are
    SchedulerQueues' (runtime/scheduler_queues.py)."""

    # ---- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        sched = self._schedule_decodes()
        if sched is not None:
            return sched
        sched = Schedule()
        budget = self.max_num_batched_tokens
        done: set[str] = set()
        spare = self._spec_spare(budget)
        chunks = False  # a running request has more than one token to compute (else the second pass has nothing)
        for decode in (True, False):
            if not decode and not chunks:
                break  # a pure decode step: skip the second walk over the running requests
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                remaining = req.num_tokens - req.num_computed_tokens
                if (remaining == 1) != decode or remaining <= 0 or req.request_id in done:
                    chunks = chunks or remaining > 1
                    i += 1
                    continue
                n = min(remaining, budget)
                if self._grow(req, n, i, done, sched, may_preempt_self=decode):
                    extra = self._draft_slots(req, min(spare, budget - n)) if decode and spare else 0
                    spare -= extra
                    self._add(sched, req, n, done, extra)
                    budget -= n + extra
                    i += 1
                elif req.status is RequestStatus.RUNNING:
                    i += 1  # a prefill chunk that cannot grow waits for a later step
        if self.policy == "static":
            if not self.running:
                self._admit_static(sched, budget, done)
        else:
            self._admit(sched, budget, done)
        return sched

    def _schedule_decodes(self) -> Schedule | None:
        """The steady state of a decode batch, without the general walk's per-request bookkeeping: when every
        running request has just its next token to compute, the budget covers them all, nobody can be admitted
        and no draft slot would be given, schedule() gives each running request one token in priority order and
        nothing else. That is what this builds; None in any other case (a request that needs a block when none
        is free included: preemption), and the general walk decides from the same state, since the blocks grown
        here are the first ones it would grow."""
        running = self.running
        n = len(running)
        if not n or n > self.max_num_batched_tokens:
            return None
        if (self.policy == "continuous" and self.waiting and n < self.max_num_seqs
                and n < self.max_num_batched_tokens):
            return None  # an admission
        spec_off = False
        if self.spec_k:
            # Draft slots are grown between the decodes' blocks, so decide before growing any: every running request
            # must be a decode (then _spec_spare counts them all), and speculation off (too many decodes) or no
            # request may speculate.
            if any(len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens != 1 for r in running):
                return None
            spec_off = self.spec_max_batch is not None and n > self.spec_max_batch
            if not spec_off and any(r.can_speculate for r in running):
                return None
        bm = self.bm
        # A table with room for the next token needs no append_slots (it would change nothing), unless the block
        # manager reserves something for every token (a routed model's routed layers).
        tables, bs = (None if bm.reserves_every_token else bm.tables), bm.block_size
        seqs = []
        for req in running:
            start, rid = req.num_computed_tokens, req.request_id
            if len(req.prompt_token_ids) + len(req.output_token_ids) - start != 1:
                return None
            if (tables is None or start >= len(tables.get(rid, ())) * bs) and not bm.append_slots(rid, start + 1):
                return None
            seqs.append(ScheduledSeq(req, start, 1, True))
        if spec_off and any(r.can_speculate for r in running):
            self.num_spec_off_steps += 1  # counted only now: had this returned None, the general walk would count it
        return Schedule(seqs, plain_decodes=True)

    def schedule_ahead(self, in_flight: list[ScheduledSeq]) -> tuple[Schedule, list[int]] | None:
        """The step after one whose sampled tokens are not on the host yet (the engine's async scheduling), and the
        indices into `in_flight` of the chunks it continues; None when that step cannot be known without them,
        and the engine takes them in and calls schedule().

        `in_flight` is every chunk of that step, each sampled (the last of its known tokens), and every running
        request has one there. The step after it is what _schedule_decodes gives once the tokens are in, on the
        assumption that no request stops on its token in flight unless max_tokens says it must: every running
        request, in priority order, decodes that token, and waiting requests are admitted after them, in arrival
        order, while seats (those of requests ending on max_tokens counted free), budget and blocks last, each
        with its whole prompt (a chunk that is cut would leave blocks to commit before sampling: a prompt that
        does not fit waits for a step scheduled from host tokens). A request whose token in flight is a stop
        token, eos or completes a stop string is found when the tokens come in; the row computed for it here is
        then dropped (and a seat it frees is used one step later than without async scheduling). None when the
        first waiting request's prompt exceeds the budget left (chunked prefill) or has prompt positions to score
        (prompt_logprobs: those are taken in with their step, never left in flight), a block is missing for a decode
        (preemption), speculation is on, or a request's sampler needs its token history (a repetition, presence or
        frequency penalty) or its output count (fewer outputs than min_tokens, whose mask depends on it);
        for a block manager that reserves per token (a routed model's: the worst case for the tokens in flight
        too, inside its ahead()), also when a request would be admitted (its prefix match records the step in
        flight). The blocks grown before a None are the first ones schedule() grows, as in _schedule_decodes. The
        indices cover the decodes, which come first.
        """
        running = self.running
        if self.spec_k or len(in_flight) != len(running):
            return None
        if all(s.request is r for s, r in zip(in_flight, running, strict=True)):
            order = range(len(running))  # a step of decodes: already in priority order
        else:  # a step with prefill chunks lists them after the decodes
            row = {id(s.request): i for i, s in enumerate(in_flight)}
            if len(row) != len(running) or any(id(r) not in row for r in running):
                return None
            order = [row[id(r)] for r in running]
        keep, starts = [], []
        for i in order:
            s = in_flight[i]
            req, end = s.request, s.start + s.num_new
            if req.num_computed_tokens != s.start or req.num_tokens != end or s.num_drafts:
                return None
            # Its sampler would read its tokens (a penalty), or its output count (min_tokens), without the one in flight
            if req.params.reads_history or len(req.output_token_ids) < req.params.min_tokens:
                return None
            if len(req.output_token_ids) + 1 < req.params.max_tokens:  # the token in flight does not end it
                keep.append(i)
                starts.append(end)
        n = len(keep)
        if not n or n > self.max_num_batched_tokens:
            return None
        budget, seats = self.max_num_batched_tokens - n, self.max_num_seqs - n
        admit = self.policy == "continuous" and self.waiting and seats > 0 and budget > 0
        if admit and self.waiting[0].num_tokens > budget:
            return None  # its prompt needs a partial chunk, whose blocks are committed before sampling
        if admit and self.waiting[0].unscored_from is not None:
            return None  # its prompt logprobs are taken in with its step (Engine.step), never in flight
        bm = self.bm
        if admit and bm.reserves_every_token:
            return None
        tables, bs = (None if bm.reserves_every_token else bm.tables), bm.block_size
        seqs = []
        with bm.ahead():
            for i, start in zip(keep, starts, strict=True):
                req = in_flight[i].request
                rid = req.request_id
                if (tables is None or start >= len(tables.get(rid, ())) * bs) and not bm.append_slots(rid, start + 1):
                    return None
                seqs.append(ScheduledSeq(req, start, 1, True))
        sched = Schedule(seqs)
        if admit:  # whole prompts only: every chunk of a step in flight is sampled
            self._admit(sched, budget, set(), seats, whole=True)
        sched.plain_decodes = len(seqs) == n
        return sched, keep

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

    def _spec_spare(self, budget: int) -> int:
        """Budget for drafts this step: what is left after one token per decode-ready request (0 when off)."""
        if not self.spec_k:
            return 0
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not any(r.can_speculate for r in decodes):
            return 0
        if self.spec_max_batch is not None and len(decodes) > self.spec_max_batch:
            self.num_spec_off_steps += 1
            return 0
        return max(budget - len(decodes), 0)

    def _draft_slots(self, req: Request, spare: int) -> int:
        """How many draft slots a decode gets: up to spec_k, within the spare budget, the tokens it may still
        generate (a step emits up to drafts + 1) and the blocks free now (no preemption for a draft)."""
        if not req.can_speculate:
            return 0
        extra = min(self.spec_k, spare, req.params.max_tokens - len(req.output_token_ids) - 1)
        if self.spec_context is not None:  # the draft model is fed positions up to num_computed + extra - 1
            extra = min(extra, self.spec_context - req.num_computed_tokens)
        if extra <= 0:
            return 0
        have = len(self.bm.table(req.request_id)) + self.bm.num_free_blocks
        extra = min(extra, have * self.bm.block_size - req.num_computed_tokens - 1)
        if extra <= 0 or not self.bm.append_slots(req.request_id, req.num_computed_tokens + 1 + extra):
            return 0
        return extra
