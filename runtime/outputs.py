"""The engine's output side: sampled tokens into their requests, stops decided, failures isolated, RequestOutputs.

Everything a scheduling decision needs happens when a token is appended (OutputMaker.append): EOS, stop ids and
max_tokens from the id, and for a request with stop strings its text (its finish depends on it), so nothing is
ever computed or emitted past a stop. The rest, the text of requests without stop strings and the RequestOutput
objects, is the output work (emit_one): done at the end of the step or, with overlap_outputs, by the next step
while its model call runs (end_step keeps it as `deferred`, the next step's emit_deferred makes it).

A failure while emitting (a detokenizer that raises) ends that request alone with finish_reason "error": the
tokens no output carried yet are rolled back and its blocks freed (fail).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kiln.runtime.batch_sampler import BatchSample, failure_text
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Detokenizer, TokenTextCache
from kiln.runtime.logprob import PositionLogprobs
from kiln.runtime.request import DONE, Request, RequestOutput
from kiln.runtime.sampling_params import SamplingParams, check_stop
from kiln.runtime.schedule import ScheduledSeq
from kiln.runtime.scheduler import Scheduler

log = logging.getLogger("kiln.runtime")

Made = list[Request | RequestOutput]  # a step's output work: requests that got tokens, and outputs already made


class OutputMaker:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, requests: dict[str, Request],
                 eos_token_ids: tuple[int, ...], overlap: bool):
        """requests: the engine's unfinished requests by id (shared; a request that ends leaves it here)."""
        self.scheduler = scheduler
        self.bm = block_manager
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self.overlap = overlap
        self.num_generated_tokens = 0
        self.token_text = TokenTextCache()  # decode([id]) for every request's detokenizer (see Detokenizer)
        self.pending: list[RequestOutput] = []  # outputs of aborted requests, returned by the next step
        # The last step's output work, made by the next step while its model call runs (overlap only).
        self.deferred: Made = []

    # ---- per token ----------------------------------------------------------------------------------------

    def append(self, req: Request, tok: int, now: float, logprobs: PositionLogprobs | None = None) -> None:
        """One sampled token into its request; ends the request when the token stops it."""
        req.output_token_ids.append(tok)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        self.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        done = stop_of(req.detokenizer, tok, len(req.output_token_ids), req.params, self.eos_token_ids)
        if done is not None:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self.finish(req, *done)

    def take_rows(self, seqs: list[ScheduledSeq], result: BatchSample, now: float, made: Made,
                  advance: bool = False) -> None:
        """A step's plain rows into their requests, in order: for each, the blocks it filled offered to the prefix
        cache (commit), then its token appended (append), with append's bookkeeping written out here because
        this runs for every row of every step. A row with an error, or whose stop-string search raised, fails its
        request alone. advance: first move num_computed_tokens past the chunk (see plain_rows.take_plain)."""
        bs, eos, commit, finish_req = self.bm.block_size, self.eos_token_ids, self.bm.commit, self.scheduler.finish
        appended = 0
        for s, tok, err, lp in zip(seqs, result.tokens, result.errors, result.logprobs, strict=True):
            req = s.request
            if req.status in DONE:  # ended while this step ran (its previous output failed)
                continue
            start = s.start
            if advance:
                req.num_computed_tokens = start + s.num_new
            if err is None:
                try:
                    n = req.num_computed_tokens
                    if n // bs > start // bs:  # only now: K/V next to non-finite logits is not offered for reuse
                        commit(req.request_id, req.all_token_ids, n)
                    out = req.output_token_ids
                    out.append(tok)
                    appended += 1
                    if lp is not None:
                        req.output_logprobs.append(lp)
                    m = req.metrics
                    if m.first_token_time is None:
                        m.first_token_time = now
                    det = req.detokenizer
                    done = stop_of(det, tok, len(out), req.params, eos)  # as in append
                    if done is not None:
                        finish_req(req)
                        self.requests.pop(req.request_id, None)
                        self.finish(req, *done)
                    made.append(req)
                    continue
                except Exception as e:  # a stop-string search (its detokenizer) failed: this request only
                    err = failure_text("emitting its output failed", e)
                finally:
                    self.num_generated_tokens += appended  # before fail() takes back what no output carried
                    appended = 0
            made.append(self.fail(req, start, err))

    def commit(self, req: Request, start: int) -> None:
        """Offer the blocks this step filled (from token `start` on) to the prefix cache."""
        if req.num_computed_tokens // self.bm.block_size > start // self.bm.block_size:
            self.bm.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)

    def fail(self, req: Request, start: int, message: str) -> RequestOutput:
        """End one request with finish_reason "error": drop what this step added, free its blocks, report why."""
        req.num_computed_tokens = start
        rolled_back = len(req.output_token_ids) - req._sent_tokens  # tokens no output carried yet
        del req.output_token_ids[req._sent_tokens :]
        del req.output_logprobs[req._sent_tokens :]
        self.num_generated_tokens -= rolled_back
        self.requests.pop(req.request_id, None)
        if not req.status.done:
            self.scheduler.finish(req)
        req.error = f"request {req.request_id!r}: {message}"
        self.finish(req, "error", None)
        log.warning("%s", req.error)
        return self.output(req)

    @staticmethod
    def finish(req: Request, reason: str, stop_reason: int | str | None) -> None:
        """Record why a request ended; its held-back text is flushed when its last output is made."""
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.metrics.finish_time = time.perf_counter()

    @staticmethod
    def flush(req: Request) -> None:
        """At the request's end: its text made up to its last token, and the held-back tail emitted."""
        try:
            OutputMaker.catch_up(req)  # a final_only request's tokens are detokenized only now
            req.detokenizer.flush()
        except Exception as e:  # the held-back tail is lost, the request still ends as asked
            req.error = f"request {req.request_id!r}: {failure_text('flushing its text failed', e)}"

    # ---- output objects -----------------------------------------------------------------------------------

    def output(self, req: Request) -> RequestOutput:
        """The output of a request that ends outside a step's output work (failed or aborted)."""
        try:
            self.catch_up(req)  # a final_only request's text is made only now
            return req.make_output()
        except Exception as e:  # a broken detokenizer: report the text already sent
            text = failure_text("emitting its output failed", e)  # logged even when an earlier error is reported
            req.error = req.error or f"request {req.request_id!r}: {text}"
            req.finish_reason = req.finish_reason or "error"
            return req.make_output(text_failed=True)

    def emit(self, made: Made) -> list[RequestOutput]:
        outs = []
        for e in made:
            if isinstance(e, RequestOutput):
                outs.append(e)
            elif e.status in DONE or e.params.output_kind != "final_only":
                outs.append(self.emit_one(e))
            else:  # final_only and running: no output, no text yet (made once, when it ends)
                e.skip_output()
        return outs

    @staticmethod
    def catch_up(req: Request) -> None:
        """Detokenize the output tokens the detokenizer has not seen (those of requests with stop strings were
        detokenized when sampled)."""
        det = req.detokenizer
        for tok in req.output_token_ids[len(det.tokens) : req.num_text_tokens]:
            det.add(tok)

    def emit_one(self, req: Request) -> RequestOutput:
        """The output of a request that got tokens: the text of those not detokenized yet, the held-back tail if
        it finished, the RequestOutput. A failure here ends this request only, with the tokens no output carried
        rolled back."""
        try:
            self.catch_up(req)
            if req.status in DONE:
                self.flush(req)
            return req.make_output()
        except Exception as e:  # a detokenizer failure ends this request only
            return self.fail(req, req.num_computed_tokens, failure_text("emitting its output failed", e))

    # ---- across steps -------------------------------------------------------------------------------------

    def take_pending(self) -> list[RequestOutput]:
        out, self.pending = self.pending, []
        return out

    def emit_deferred(self) -> list[RequestOutput]:
        """The last step's output work (overlap: called while this step's model call runs)."""
        deferred, self.deferred = self.deferred, []
        return self.emit(deferred)

    def end_step(self, made: Made) -> list[RequestOutput]:
        """This step's output work: made now, or kept for the next step (overlap)."""
        if self.overlap:
            self.deferred = made
            return []
        return self.emit(made)

    def abort_deferred(self, req: Request) -> bool:
        """Before aborting `req`: make the output of its last step if it is still deferred (it comes first, as it
        would have a step earlier without the overlap). False when making it ended the request (it failed)."""
        if not any(e is req for e in self.deferred):
            return True
        self.deferred = [e for e in self.deferred if e is not req]
        self.pending += self.emit([req])
        return not req.status.done

    def has_work(self) -> bool:
        return bool(self.pending) or bool(self.deferred)


def stop_of(det: Detokenizer, tok: int, num_output: int, params: SamplingParams,
            eos_token_ids: Sequence[int]) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) when the token just appended ends its request, else None. A stop token comes
    first: its text stays out of the output (Request.num_text_tokens), so no stop string is searched in it. Only a
    request with stop strings needs its text now; the others' is made with their output (emit_one)."""
    done = check_stop(tok, num_output, params, eos_token_ids)
    if det.stop and (done is None or done[0] == "length"):
        stop_str = det.add(tok)
        if stop_str is not None:
            return "stop", stop_str
    return done
