"""Async scheduling: a decode step is launched before the previous step's sampled ids reach the host.

Without it the host reads step N's ids, appends them, then schedules and prepares step N + 1 while the device
waits. With it (Engine(async_scheduling=True)) a step whose every chunk is sampled (decodes, and prefill chunks
that finish their prompts; no drafts) stays in flight after its launch; the next step() call schedules the step
after it (Scheduler.schedule_ahead: every running request decodes on, except those whose token in flight reaches
max_tokens, and waiting requests whose whole prompts fit are admitted after them), launches it with N's sampled
ids copied into its decodes' input tokens on the device (ModelRunner.prepare(tokens=...)), and only then reads
N's ids back and makes N's outputs, while the device computes N + 1. A request that stopped on its token in
flight (eos, a stop id or string, a failure) is found then; the row N + 1 computed for it is dropped (take_rows
skips finished requests) and its blocks, the one grown for that row included, are freed with it. In stream order
nothing reuses them before N + 1 has run.

Where the next step needs the ids on the host (schedule_ahead says None: a prompt that must be cut into chunks,
a preemption, a penalty, min_tokens not reached yet), the step in flight is landed first: taken in with its
outputs deferred, exactly the state overlap_outputs alone leaves, and scheduling goes on from there. A step
with a partial prefill chunk (its blocks are committed before sampling), speculative rows or prompt positions to
score (prompt_logprobs) is taken in where it is launched, as without async scheduling. Not built for speculative
decoding (the drafter reads the last token on the host).

A Mixture-of-Depths model's step also takes each routed layer's cache length c_j, which depends on the routing of
the step in flight: its block manager reserves the worst case for that step's tokens without recording it, the
step is prepared from the recorded c_j plus that step's routed counts added on the device
(ModelRunner._add_pending_routing), and that step is recorded by the next record_step, when its flags are due
anyway (runtime/routed_blocks.py). A step ahead of a routed model admits nobody: an admission's prefix match
records the step in flight first, so it waits for a step scheduled from host state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.runtime.batch_sampler import LaunchedSample
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.outputs import Made, OutputMaker
from kiln.runtime.plain_rows import launch_plain, take_plain
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampler import to_device
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.runtime.scheduler import Scheduler


@dataclass
class InFlight:
    """A step launched and not taken in yet, every chunk of it sampled: its chunks (in row order) and its
    sampler's work."""

    seqs: list[ScheduledSeq]
    launched: LaunchedSample | str  # str: why its sampling failed as a whole (take_plain fails every row)


class AsyncSteps:
    """The engine's step in flight, if any, and how the next one is launched ahead of it."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, output: OutputMaker):
        self.scheduler = scheduler
        self.runner = runner
        self.output = output
        self.flight: InFlight | None = None
        self.num_steps_ahead = 0  # steps launched before the previous step's sampled ids were on the host

    def launch_ahead(self) -> tuple[Schedule, InFlight] | None:
        """Schedule and launch the step after the one in flight, its input tokens taken on the device from the
        sampled ids in flight. Returns that step's schedule and the step that was in flight, for the caller to
        take in while the device runs the new one (now `flight`); None, with nothing launched, when the next
        step needs those ids on the host first (the caller lands the step in flight and schedules as usual)."""
        flight = self.flight
        launched = flight.launched if flight is not None else None
        if launched is None or isinstance(launched, str) or launched.tokens is None:
            return None
        got = self.scheduler.schedule_ahead(flight.seqs)
        if got is None:
            return None
        sched, keep = got
        tokens = launched.tokens
        if keep != list(range(tokens.shape[0])):  # some end with their token in flight, or the order changes
            tokens = tokens.index_select(0, to_device(torch.tensor(keep), tokens.device))
        logits, _ = self.runner.execute(sched, tokens)
        self.num_steps_ahead += 1
        self.flight = InFlight(sched.seqs, launch_plain(sched.seqs, list(range(len(sched.seqs))), logits,
                                                        self.output.eos_token_ids))
        return sched, flight

    def take(self, flight: InFlight) -> list[RequestOutput]:
        """Take a step in: its sampled ids read back and appended, stops decided, its outputs made now."""
        return self.output.emit(self._take_in(flight))

    def land(self) -> None:
        """Take the step in flight in now; its outputs become deferred work, as with overlap_outputs alone, so
        they come with the next step() call."""
        flight, self.flight = self.flight, None
        if flight is not None:
            self.output.deferred += self._take_in(flight)

    def _take_in(self, flight: InFlight) -> Made:
        made: Made = []
        take_plain(self.output, flight.seqs, flight.launched, time.perf_counter(), made, advance=True)
        return made

    def writing(self) -> dict[str, int]:
        """The tokens the step in flight writes, by request."""
        return {s.request.request_id: s.num_new for s in self.flight.seqs} if self.flight is not None else {}
