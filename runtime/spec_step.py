"""The engine's speculative side, one step at a time: fill the draft slots the scheduler reserved, then take the
verifier's verdict into the requests (accepted drafts and the next token appended, the rest rolled back).

The drafter is an optimisation: when it raises, the step decodes without drafts. When the verifier raises, the
step's speculative rows fail (their requests end with "error"), not the engine. Unused draft slots' blocks are
freed by the engine with the step's other reservations (BlockManager.truncate).
"""

from __future__ import annotations

import logging

import torch

from kiln.errors import KilnError
from kiln.runtime.batch_sampler import NONFINITE_LOGITS, failure_text
from kiln.runtime.engine_stats import SpecCounters
from kiln.runtime.outputs import Made, OutputMaker
from kiln.runtime.schedule import ScheduledSeq
from kiln.runtime.speculative import Draft, ModelDrafter, NgramDrafter, SpecRow, verify_rows
from kiln.step import Verifier

log = logging.getLogger("kiln.runtime")


class SpecStep:
    def __init__(self, drafter: NgramDrafter | ModelDrafter, verify: Verifier, output: OutputMaker,
                 counters: SpecCounters):
        self.drafter = drafter
        self.verify_fn = verify
        self.output = output
        self.counters = counters

    def propose(self, reserved: list[ScheduledSeq]) -> dict[int, Draft]:
        """Fill the reserved draft slots (by id() of the chunk); a sequence that gets no draft runs as a plain
        decode."""
        try:
            drafts = self.drafter.propose(reserved)
        except Exception as e:  # the drafter is an optimisation: without it every row is a plain decode
            text = f"the drafter failed ({type(e).__name__}: {e}); this step decodes without speculation"
            if isinstance(e, KilnError) or self.counters.drafter_failures:
                log.warning("%s", text)
            else:  # a bug in kiln: its traceback once, not on every step a broken drafter fails
                log.error("%s (this is a bug in kiln)", text, exc_info=e)
            self.counters.drafter_failures += 1
            drafts = [Draft([], None)] * len(reserved)
        out = {}
        for s, d in zip(reserved, drafts, strict=True):
            n = min(len(d.tokens), s.num_drafts)
            d = Draft(d.tokens[:n], None if d.probs is None else d.probs[:n])
            s.request.draft_tokens = d.tokens
            s.num_drafts, s.num_new = n, 1 + n
            out[id(s)] = d
        return out

    def verify(self, spec: list[SpecRow], logits: torch.Tensor, now: float, made: Made) -> None:
        """Accept each speculative decode's draft prefix, append it and the next token, roll back the rest."""
        c, output = self.counters, self.output
        try:
            results = verify_rows(self.verify_fn, logits, spec)
        except Exception as e:  # the verifier's failure loses this step's speculative rows, not the engine
            results = [(0, 0, False)] * len(spec)
            err_all = failure_text("verifying the drafts failed", e)
        else:
            err_all = None
        c.verify_steps += 1
        for it, (a, nxt, finite) in zip(spec, results, strict=True):
            s, req, n = it.seq, it.seq.request, it.seq.num_drafts
            req.draft_tokens = []
            if err_all is not None or not finite:
                made.append(output.fail(req, s.start, err_all or NONFINITE_LOGITS))
                continue
            req.num_computed_tokens = s.start + 1 + a
            self.drafter.verified(req, s.start, n, a)
            req.metrics.num_draft_tokens += n
            req.metrics.num_accepted_tokens += a
            c.proposed += n
            c.accepted += a
            c.rows += 1
            try:
                for tok in (*it.draft.tokens[:a], nxt):
                    output.append(req, tok, now)
                    c.emitted += 1
                    if req.status.done:
                        break  # a stop token, stop string or max_tokens: the rest is dropped
                if not req.status.done:  # the unused draft slots are freed with the step's other reservations
                    output.commit(req, s.start)
                made.append(req)
            except Exception as e:  # a stop-string search (its detokenizer) failed: this request only
                made.append(output.fail(req, s.start, failure_text("emitting its output failed", e)))
