"""The serving engine: requests in, one batched model step at a time, outputs (streaming deltas) out.

    engine = Engine(step_model, tokenizer, cfg)
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

A bad request raises RequestError from add_request and is never queued, so the others keep being served. A
request that fails later, while its token is sampled or its output emitted (a sampler error, non-finite logits,
a detokenizer or stop-string exception), finishes alone with finish_reason "error" and a message in
RequestOutput.error; its blocks are freed and the rest of the batch goes on in the same step.

A step is: schedule (runtime/scheduler.py), fill the draft slots (spec_step.py), the model call
(model_runner.py), the sampler's device work for the plain rows (plain_rows.py), the last step's deferred output
work (overlap_outputs), then the sampled ids read back and taken into the requests (plain_rows.py, and the
verification of drafts in spec_step.py); tokens, stops, failures and RequestOutputs are outputs.py's, the
counters engine_stats.py's. With async_scheduling a step whose chunks are all sampled is left in flight: the next
step() call schedules and launches the decode step after it first, its input tokens copied from the sampled ids
on the device (Scheduler.schedule_ahead, async_steps.py), and only then takes the one in flight in (step()).

A request with prompt_logprobs has the rows of its prompt positions returned too, after the sampled ones, and
scored before its tokens are taken in (runtime/prompt_logprobs.py); a step with such rows is never left in flight.

With a drafter (runtime/speculative.py) decodes speculate: the scheduler reserves draft slots, the drafter fills
them, the target scores [last token, drafts] in the same step as everything else, the model's verifier accepts
a prefix and draws the next token, and the unused slots' blocks are freed. Ordinary rows in the same step are
sampled as without speculation.

A Mixture-of-Depths step model (num_routed_layers > 0) gets a RoutedBlockManager (runtime/routed_blocks.py): routed
layers cache only their routed tokens, in pools sized from the routed capacity (the KV memory saved is logged and in
the stats); prefix caching shares their state with the dense blocks; speculation is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kiln.runtime.async_steps import InFlight
from kiln.runtime.engine_requests import EngineRequests
from kiln.runtime.engine_stats import EngineStats, collect_stats, kv_waste
from kiln.runtime.outputs import Made
from kiln.runtime.plain_rows import launch_plain, take_plain
from kiln.runtime.prompt_logprobs import launch_prompt, prompt_rows, take_prompt
from kiln.runtime.request import RequestOutput, RequestStatus
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.runtime.speculative import Draft, SpecRow

__all__ = ["Engine", "EngineStats"]


class Engine(EngineRequests):
    """Requests in, one batched model step at a time, outputs out (see the module docstring); the constructor, which
    builds the engine's parts, and the overlap_outputs / async_scheduling switches are EngineSetup's
    (runtime/engine_setup.py), add_request and max_tokens_for EngineRequests' (runtime/engine_requests.py)."""

    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens

    # ---- requests -----------------------------------------------------------------------------------------

    def abort(self, request_id: str, notify: bool = True) -> bool:
        """Stop a request (waiting or running) and free its blocks; False if it is unknown or already done.

        With notify, its final output (finish_reason "abort") comes with the next step. With overlap_outputs, the
        output of its last step, not made yet, comes first (notify or not), and a request that finished in the last
        step gives False: its final output is still to come.
        """
        self.ahead.land()  # as if its tokens had come in with the last step (overlap_outputs' state)
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        if not self.output.abort_deferred(req):  # making its deferred output failed: the request ended there
            return False
        self.scheduler.finish(req, RequestStatus.ABORTED)
        self.output.finish(req, "abort", None)
        if notify:
            self.output.flush(req)
            self.output.pending.append(self.output.output(req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.output.has_work() or self.ahead.flight is not None

    # ---- stepping -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched model step; outputs for every request that got a token or finished.

        Whether a request finishes is decided here, from the sampled ids (stop token, eos, max_tokens) or, for a
        request with stop strings, from its text, which is then made at once. The rest of the output work (the
        text of requests without stop strings, the RequestOutput objects) is done at the end of the step or,
        with overlap_outputs, by the next step between launching its model call and reading its sampled ids
        back: the host works while the device computes, and each output comes one step() call later. Nothing is
        computed for a finished request either way; a request whose output work fails (its detokenizer raised)
        ends with finish_reason "error", as without the overlap, and the row the step in flight computed for
        it is dropped.

        With async_scheduling (which implies the overlap) a step whose every chunk is sampled (decodes, and prefill
        chunks that end their prompts; no drafts) is not taken in where it was launched: the next call first
        schedules the step after it as if no request stopped on a token not yet seen (Scheduler.schedule_ahead;
        max_tokens is known; waiting requests whose whole prompts fit are admitted after the decodes), launches
        it with the sampled ids as the decodes' input tokens, copied on the device, and then reads the ids back
        and makes the outputs while the device computes. The host's scheduling and step preparation then hide
        behind the device too. A request that did stop on its token in flight (eos, a stop id or string, an
        error) had one more row computed, which is dropped; where the next step cannot be known without the ids
        (a prompt that needs a partial chunk, a block is missing, a penalty, min_tokens), the call takes the step
        in flight in first and schedules as without it. The outputs are the same as with overlap_outputs alone,
        one call after their step, request for request; an admission may come a step later (the seats and
        blocks of requests that stop on a token in flight are freed only when it comes in). abort() takes the
        step in flight in first.
        """
        output = self.output
        outputs = output.take_pending()
        if self.ahead.flight is not None:  # async scheduling: the last step's ids are still on the device
            got = self.ahead.launch_ahead() if self._async else None
            if got is not None:  # the host takes the last step in while the device runs the one just launched
                sched, last = got
                self.num_steps += 1
                self.num_batched_tokens += sched.num_tokens
                outputs += self.ahead.take(last)
                if all(s.request.status.done for s in sched.seqs):  # all of them ended: nothing to wait for
                    self.ahead.land()
                return outputs
            self.ahead.land()  # its outputs are the deferred work of the step scheduled now, from its tokens
        sched = self.scheduler.schedule()
        if not sched.seqs:
            # Cannot happen while the pool holds one max-length sequence; fail loudly rather than spin forever.
            assert not self.scheduler.has_unfinished(), "the scheduler made no progress with requests queued"
            return outputs + output.emit_deferred()
        reserved = [s for s in sched.seqs if s.num_drafts]
        drafts = self.spec.propose(reserved) if reserved else {}
        self.num_steps += 1
        self.num_batched_tokens += sched.num_tokens
        prompt = None if sched.plain_decodes else prompt_rows(sched.seqs)  # prompt_logprobs' rows
        logits, sampled = self.runner.execute(sched, prompt=prompt)
        plain, rows, spec = self._split_rows(sched, sampled, drafts)
        launched = launch_plain(plain, rows, logits, self.eos_token_ids) if plain else None
        scored = launch_prompt(prompt) if prompt else None
        # Taken only now: if the model call raised, the last step's outputs are still made by the next call.
        outputs += output.emit_deferred()  # host work while the device runs this step (on CUDA)
        made: Made = []
        # Every chunk sampled, none speculative: nothing to do before sampling but advancing each chunk, which
        # take_plain does (a partial prefill chunk would need its blocks committed first).
        every_chunk_sampled = sched.plain_decodes or (not spec and len(plain) == len(sched.seqs))
        if self._async and every_chunk_sampled and launched is not None and not prompt:
            self.ahead.flight = InFlight(plain, launched)  # taken in by the next call, after it launches the next
            return outputs
        if sched.plain_decodes:  # one plain row per chunk: no commit before sampling, no drafts, no reservations
            take_plain(output, plain, launched, time.perf_counter(), made, advance=True)
            return outputs + output.end_step(made)
        if prompt:  # before the tokens: a request's first output carries its prompt logprobs
            take_prompt(output, prompt, scored, made)
        for s in sched.seqs:
            if s.request.status.done:  # its last output failed just now: what this step computed for it is dropped
                continue
            s.request.num_computed_tokens = s.start + s.num_new
            if not s.sample:
                output.commit(s.request, s.start)
        now = time.perf_counter()
        if plain:
            take_plain(output, plain, launched, now, made)
        spec = [it for it in spec if not it.seq.request.status.done]
        if spec:
            self.spec.verify(spec, logits, now, made)
        for s in reserved:  # slots of drafts not proposed or not accepted
            if not s.request.status.done:
                self.block_manager.truncate(s.request.request_id, s.request.num_computed_tokens)
        return outputs + output.end_step(made)

    @staticmethod
    def _split_rows(sched: Schedule, sampled: list[ScheduledSeq],
                    drafts: dict[int, Draft]) -> tuple[list[ScheduledSeq], list[int], list[SpecRow]]:
        """The sampled chunks' logit rows: plain chunks and their rows, and the speculative rows."""
        if sched.plain_decodes:
            return sampled, list(range(len(sampled))), []
        plain: list[ScheduledSeq] = []
        rows: list[int] = []
        spec: list[SpecRow] = []
        row = 0
        for s in sampled:
            if s.num_drafts:
                spec.append(SpecRow(s, row, drafts[id(s)]))
            else:
                plain.append(s)
                rows.append(row)
            row += 1 + s.num_drafts  # s.num_rows of a sampled chunk
        return plain, rows, spec

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding each step's outputs."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each, in finishing order."""
        return [out for out in self.stream() if out.finished]

    # ---- stats --------------------------------------------------------------------------------------------

    def kv_waste(self) -> list[int]:
        """Allocated minus used (K/V written) slots of each running request."""
        return kv_waste(self.block_manager, self.scheduler, self.ahead.writing())

    @property
    def stats(self) -> EngineStats:
        return collect_stats(self.block_manager, self.scheduler, self.spec_counters, num_steps=self.num_steps,
                             num_batched_tokens=self.num_batched_tokens,
                             num_generated_tokens=self.num_generated_tokens, kv_bytes=self.kv_bytes,
                             kv_bytes_dense=self.kv_bytes_dense, num_steps_ahead=self.ahead.num_steps_ahead,
                             writing=self.ahead.writing())

    def stats_dict(self) -> dict:
        return self.stats.as_dict()
