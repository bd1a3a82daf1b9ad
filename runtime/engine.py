"""The serving engine: requests in, one batched model step at a time, outputs (streaming deltas) out.

    engine = Engine(step_model, tokenizer, cfg)
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

A bad request raises RequestError from add_request and is never queued, so the others keep being served. A
request that fails later, while its token is sampled or its output emitted (a sampler error, non-finite logits,
a detokenizer or stop-string exception), finishes alone with finish_reason "error" and a message in
RequestOutput.error; its blocks are freed and the rest of the batch goes on in the same step.

With a drafter (runtime/speculative.py) decodes speculate: the scheduler reserves draft slots, the drafter fills
them, the target scores [last token, drafts] in the same step as everything else, the model's verifier accepts
a prefix and draws the next token, and the unused slots' blocks are freed. Ordinary rows in the same step are
sampled as without speculation.

A Mixture-of-Depths step model (num_routed_layers > 0) gets a RoutedBlockManager (runtime/routed_blocks.py): its
routed layers cache only their routed tokens in pools of their own, sized from the routed capacity; the KV memory
this saves is logged and in the stats. Prefix caching shares the routed layers' state with the dense blocks; speculation
is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kiln.errors import KilnError, RequestError
from kiln.runtime.batch_sampler import NONFINITE_LOGITS, BatchSample, LaunchedSample, launch_batch
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.kv_pool import choose_num_blocks, routed_bytes_per_block
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request, RequestOutput, RequestStatus, check_prompt
from kiln.runtime.routed_blocks import RoutedBlockManager, make_block_manager, pool_bytes
from kiln.runtime.sampler import SamplingParams, check_stop, make_generator, to_device
from kiln.runtime.scheduler import ScheduledSeq, Scheduler
from kiln.runtime.speculative import (
    DEFAULT_SPECULATION_MAX_BATCH,
    Draft,
    ModelDrafter,
    NgramDrafter,
    SpecRow,
    verify_rows,
)
from kiln.step import KV_BLOCK_MAX, ModelLimits, StepModel, TokenizerLike, num_routed_layers

log = logging.getLogger("kiln.runtime")


class _BatchLost(Exception):
    """The sampler failed for the whole batch before its host copy (the message says why)."""


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


class Engine:
    def __init__(
        self,
        step_model: StepModel,
        tokenizer: TokenizerLike | None,
        cfg: ModelLimits,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        use_cuda_graphs: bool | None = None,
        pad_decode_batches: bool = False,
        scheduling_policy: str = "continuous",
        max_model_len: int | None = None,
        drafter: NgramDrafter | ModelDrafter | None = None,
        speculation_max_batch: int | None = None,
        routed_num_blocks: int | None = None,
        overlap_outputs: bool | None = None,
    ):
        """drafter: speculative decoding (the verifier is step_model.verify). speculation_max_batch: speculate only
        while at most this many decode-ready requests run (None: DEFAULT_SPECULATION_MAX_BATCH, measured).
        routed_num_blocks: blocks in each routed layer's pool of a Mixture-of-Depths model (None: from its routed
        capacity, see runtime/kv_pool.py). overlap_outputs: build each step's outputs during the next step's model
        call (see step(); None: on for a CUDA model, whose calls are asynchronous, off elsewhere, where it could
        only delay the outputs)."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise KilnError(f"{name} = {value!r} is out of range; allowed: an integer >= 1")
        self.model = step_model
        self.tokenizer = tokenizer
        self.cfg = cfg
        # max_model_len below the model's context shrinks the smallest acceptable pool (one max-length sequence).
        self.max_model_len = cfg.context if max_model_len is None else min(int(max_model_len), cfg.context)
        self.eos_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        if block_size is None:  # the compile config's kv_cache = paged(block = ...), carried by the step model
            block_size = getattr(step_model, "block_size", 16)
        if not (1 <= block_size <= KV_BLOCK_MAX and block_size & (block_size - 1) == 0):
            raise KilnError(f"block_size = {block_size}: a KV cache block must hold a power of two from 1 to "
                            f"{KV_BLOCK_MAX} tokens (the attention kernels' key tiles cover whole blocks); "
                            "use --block-size 16")
        self.verify = getattr(step_model, "verify", None) if drafter is not None else None
        if drafter is not None and self.verify is None:
            raise KilnError("speculative decoding needs a verifier, but this step model has no `verify`; compile it "
                            "with speculation (compile key `speculation`, or --speculation / LLM(speculation=...))")
        if speculation_max_batch is not None and not (isinstance(speculation_max_batch, int)
                                                      and speculation_max_batch >= 0):
            raise KilnError(f"speculation_max_batch = {speculation_max_batch!r} is out of range; allowed: an "
                            "integer >= 0 (0 turns speculation off) or None for the measured default")
        if num_routed_layers(step_model) and drafter is not None:
            raise KilnError("speculative decoding is not built for Mixture-of-Depths models (its rejected drafts would "
                            "have to be taken back out of every routed layer's cache); serve this model with "
                            "speculation off (--speculation off, LLM(speculation='off'))")
        extra = drafter.kv_bytes_per_block(block_size) if drafter is not None else 0
        extra += routed_bytes_per_block(step_model, block_size)
        n = choose_num_blocks(step_model, self.max_model_len, block_size=block_size, num_blocks=num_blocks,
                              gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                              extra_bytes_per_block=extra)
        self.block_manager: BlockManager = make_block_manager(
            step_model, n, block_size, self.max_model_len, enable_prefix_caching, routed_num_blocks)
        self.kv_bytes, self.kv_bytes_dense = pool_bytes(step_model, self.block_manager)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, policy=scheduling_policy)
        graphs = step_model.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.runner = ModelRunner(step_model, self.block_manager, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, use_cuda_graphs=graphs,
                                  pad_decode_batches=pad_decode_batches)
        self.drafter = drafter
        if drafter is not None:
            drafter.bind(step_model, self.block_manager, self.runner.kv_cache, max_num_seqs=max_num_seqs,
                         max_model_len=self.max_model_len, max_num_batched_tokens=max_num_batched_tokens)
            self.scheduler.spec_k = drafter.k
            self.scheduler.spec_max_batch = (DEFAULT_SPECULATION_MAX_BATCH if speculation_max_batch is None
                                             else speculation_max_batch)
        self.spec = {"proposed": 0, "accepted": 0, "verify_steps": 0, "rows": 0, "emitted": 0, "drafter_failures": 0}
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, returned by the next step
        self.overlap_outputs = step_model.device.type == "cuda" if overlap_outputs is None else bool(overlap_outputs)
        # The last step's output work, done by the next step while its model call runs (overlap_outputs): requests
        # that got tokens (their text and output object still to make) and outputs already made (failures), in order.
        self._deferred: list[Request | RequestOutput] = []
        self._token_text: dict[int, str] = {}  # decode([id]) for every request's detokenizer (see Detokenizer)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.num_generated_tokens = 0

    # ---- requests -----------------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | dict | None = None,
                    request_id: str | None = None, *, prompt_token_ids: Sequence[int] | None = None) -> str:
        """Queue one request and return its id. A prompt is text (tokenized here) or token ids: a sequence of
        ints, a 1-D numpy array or a 1-D integer tensor. params: a SamplingParams or a dict of its fields."""
        params = SamplingParams.coerce(params, "params").validate()
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt_token_ids = prompt
        if prompt_token_ids is None:
            if text is None:
                raise RequestError("no prompt: give prompt text or prompt_token_ids")
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; give prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(text)
        ids = self._check_prompt(prompt_token_ids, params)
        order = next(self._ids)
        rid = str(order) if request_id is None else str(request_id)
        while request_id is None and rid in self.requests:  # a caller took this number as its own id
            rid = str(next(self._ids))
        if rid in self.requests:
            raise RequestError(f"request_id {rid!r} is already in use by an unfinished request; pick another")
        req = Request(rid, text, ids, params, Detokenizer(self.tokenizer, params.stop, self._token_text),
                      make_generator(params.seed, self.model.device), order)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        limit = "model context" if self.max_model_len == self.cfg.context else "engine's max_model_len"
        ids = check_prompt(prompt_token_ids, params.max_tokens, vocab=self.model.vocab, limit=self.max_model_len,
                           limit_name=limit)
        total = len(ids) + params.max_tokens
        bm = self.block_manager
        if bm.blocks_for(total) > bm.num_usable_blocks:
            raise RequestError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} needs {bm.blocks_for(total)} KV "
                f"blocks but the pool has {bm.num_usable_blocks}; lower max_tokens or raise --num-blocks")
        return ids

    def abort(self, request_id: str, notify: bool = True) -> bool:
        """Stop a request (waiting or running) and free its blocks; False if it is unknown or already done.

        With notify, its final output (finish_reason "abort") comes with the next step. With overlap_outputs, the
        output of its last step, not made yet, comes first (notify or not), and a request that finished in the last
        step gives False: its final output is still to come.
        """
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        if any(e is req for e in self._deferred):  # the last step's output for it is not made yet: it comes first
            self._deferred = [e for e in self._deferred if e is not req]
            self._pending.append(self._emit_one(req))  # an ordinary output (made a step earlier without overlap)
            if req.status.done:  # making it failed: the request ended there, as it would have a step earlier
                return False
        self.scheduler.finish(req, RequestStatus.ABORTED)
        self._finish(req, "abort", None)
        if notify:
            self._flush(req)
            self._pending.append(self._output(req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._deferred)

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
        """
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.seqs:
            # Cannot happen while the pool holds one max-length sequence; fail loudly rather than spin forever.
            assert not self.scheduler.has_unfinished(), "the scheduler made no progress with requests queued"
            deferred, self._deferred = self._deferred, []
            return outputs + self._emit(deferred)
        reserved = [s for s in sched.seqs if s.num_drafts]
        drafts = self._propose(reserved)
        self.num_steps += 1
        self.num_batched_tokens += sched.num_tokens
        logits, sampled = self.runner.execute(sched)
        plain: list[tuple[ScheduledSeq, int]] = []
        spec: list[SpecRow] = []
        row = 0
        for s in sampled:
            if s.num_drafts:
                spec.append(SpecRow(s, row, drafts[id(s)]))
            else:
                plain.append((s, row))
            row += 1 + s.num_drafts  # s.num_rows of a sampled chunk
        launched = self._launch_plain(plain, logits) if plain else None
        # Taken only now: if the model call raised, the last step's outputs are still made by the next call.
        deferred, self._deferred = self._deferred, []
        outputs += self._emit(deferred)  # host work while the device runs this step (on CUDA)
        for s in sched.seqs:
            if s.request.status.done:  # its last output failed just now: what this step computed for it is dropped
                continue
            s.request.num_computed_tokens = s.start + s.num_new
            if not s.sample:
                self._commit(s.request, s.start)
        now = time.perf_counter()
        made: list[Request | RequestOutput] = []
        if plain:
            self._sample_plain(plain, launched, now, made)
        spec = [it for it in spec if not it.seq.request.status.done]
        if spec:
            self._verify(spec, logits, now, made)
        for s in reserved:  # slots of drafts not proposed or not accepted
            if not s.request.status.done:
                self.block_manager.truncate(s.request.request_id, s.request.num_computed_tokens)
        if self.overlap_outputs:
            self._deferred = made
            return outputs
        return outputs + self._emit(made)

    def _propose(self, reserved: list[ScheduledSeq]) -> dict[int, Draft]:
        """Fill the reserved draft slots; a sequence that gets no draft runs as a plain decode."""
        if not reserved:
            return {}
        try:
            drafts = self.drafter.propose(reserved)
        except Exception as e:  # the drafter is an optimisation: without it every row is a plain decode
            log.warning("the drafter failed (%s: %s); this step decodes without speculation", type(e).__name__, e)
            self.spec["drafter_failures"] += 1
            drafts = [Draft([], None)] * len(reserved)
        out = {}
        for s, d in zip(reserved, drafts, strict=True):
            n = min(len(d.tokens), s.num_drafts)
            d = Draft(d.tokens[:n], None if d.probs is None else d.probs[:n])
            s.request.draft_tokens = d.tokens
            s.num_drafts, s.num_new = n, 1 + n
            out[id(s)] = d
        return out

    @staticmethod
    def _launch_plain(plain: list[tuple[ScheduledSeq, int]], logits) -> LaunchedSample | str:
        """The sampler's device work for the plain rows, or why it failed (then every plain row fails)."""
        reqs = [s.request for s, _ in plain]
        try:
            # A list index would be a synchronous host -> device copy (the host would wait for the model call).
            rows = logits if len(plain) == logits.shape[0] else logits.index_select(
                0, to_device(torch.tensor([r for _, r in plain]), logits.device))
            return launch_batch(rows, [r.params for r in reqs], [r.generator for r in reqs],
                                [r.all_token_ids if r.params.repetition_penalty != 1.0 else () for r in reqs])
        except Exception as e:  # not one row's fault (launch_batch isolates rows): the batch is lost, not the engine
            return f"sampling the batch failed ({type(e).__name__}: {e})"

    def _sample_plain(self, plain: list[tuple[ScheduledSeq, int]], launched: LaunchedSample | str, now: float,
                      made: list[Request | RequestOutput]) -> None:
        try:
            if isinstance(launched, str):
                raise _BatchLost(launched)
            result = launched.result()
        except Exception as e:
            err = str(e) if isinstance(e, _BatchLost) else f"sampling the batch failed ({type(e).__name__}: {e})"
            result = BatchSample([0] * len(plain), [err] * len(plain))
        for (s, _), tok, err, lp in zip(plain, result.tokens, result.errors, result.logprobs, strict=True):
            req = s.request
            if req.status.done:  # ended while this step ran (its previous output failed)
                continue
            if err is None:
                try:
                    self._commit(req, s.start)  # only now: K/V next to non-finite logits is not offered for reuse
                    self._append(req, tok, now, lp)
                    made.append(req)
                    continue
                except Exception as e:  # a stop-string search (its detokenizer) failed: this request only
                    err = f"emitting its output failed ({type(e).__name__}: {e})"
            made.append(self._fail(req, s.start, err))

    def _verify(self, spec: list[SpecRow], logits, now: float, made: list[Request | RequestOutput]) -> None:
        """Accept each speculative decode's draft prefix, append it and the next token, roll back the rest."""
        try:
            results = verify_rows(self.verify, logits, spec)
        except Exception as e:  # the verifier's failure loses this step's speculative rows, not the engine
            results = [(0, 0, False)] * len(spec)
            err_all = f"verifying the drafts failed ({type(e).__name__}: {e})"
        else:
            err_all = None
        self.spec["verify_steps"] += 1
        for it, (a, nxt, finite) in zip(spec, results, strict=True):
            s, req, n = it.seq, it.seq.request, it.seq.num_drafts
            req.draft_tokens = []
            if err_all is not None or not finite:
                made.append(self._fail(req, s.start, err_all or NONFINITE_LOGITS))
                continue
            req.num_computed_tokens = s.start + 1 + a
            self.drafter.verified(req, s.start, n, a)
            req.metrics.num_draft_tokens += n
            req.metrics.num_accepted_tokens += a
            self.spec["proposed"] += n
            self.spec["accepted"] += a
            self.spec["rows"] += 1
            try:
                for tok in (*it.draft.tokens[:a], nxt):
                    self._append(req, tok, now)
                    self.spec["emitted"] += 1
                    if req.status.done:
                        break  # a stop token, stop string or max_tokens: the rest is dropped
                if not req.status.done:  # the unused draft slots are freed with the step's other reservations
                    self._commit(req, s.start)
                made.append(req)
            except Exception as e:  # a stop-string search (its detokenizer) failed: this request only
                made.append(self._fail(req, s.start, f"emitting its output failed ({type(e).__name__}: {e})"))

    def _commit(self, req: Request, start: int) -> None:
        if req.num_computed_tokens // self.block_manager.block_size > start // self.block_manager.block_size:
            self.block_manager.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)  # a block filled

    def _fail(self, req: Request, start: int, message: str) -> RequestOutput:
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
        self._finish(req, "error", None)
        log.warning("%s", req.error)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        try:
            return req.make_output()
        except Exception as e:  # a broken detokenizer: report the text already sent
            req.error = req.error or f"request {req.request_id!r}: emitting its output failed ({type(e).__name__}: {e})"
            req.finish_reason = req.finish_reason or "error"
            return req.make_output(text_failed=True)

    def _append(self, req: Request, tok: int, now: float, logprobs: dict[int, float] | None = None) -> None:
        req.output_token_ids.append(tok)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        self.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        # Only a stop string needs the text now; other requests' text is made with their output (_emit_one).
        stop_str = req.detokenizer.add(tok) if req.detokenizer.stop else None
        done = ("stop", stop_str) if stop_str is not None else check_stop(
            tok, len(req.output_token_ids), req.params, self.eos_token_ids)
        if done is not None:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self._finish(req, *done)

    @staticmethod
    def _finish(req: Request, reason: str, stop_reason: int | str | None) -> None:
        """Record why a request ended; its held-back text is flushed when its last output is made."""
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.metrics.finish_time = time.perf_counter()

    @staticmethod
    def _flush(req: Request) -> None:
        try:
            req.detokenizer.flush()
        except Exception as e:  # the held-back tail is lost, the request still ends as asked
            req.error = f"request {req.request_id!r}: flushing its text failed ({type(e).__name__}: {e})"

    def _emit(self, made: list[Request | RequestOutput]) -> list[RequestOutput]:
        return [e if isinstance(e, RequestOutput) else self._emit_one(e) for e in made]

    def _emit_one(self, req: Request) -> RequestOutput:
        """The output of a request that got tokens: the text of those not detokenized yet, the held-back tail if
        it finished, the RequestOutput. A failure here ends this request only, with the tokens no output carried
        rolled back."""
        try:
            det = req.detokenizer
            for tok in req.output_token_ids[len(det.tokens) :]:
                det.add(tok)  # no stop strings here (those requests were detokenized when sampled)
            if req.status.done:
                self._flush(req)
            return req.make_output()
        except Exception as e:  # a detokenizer failure ends this request only
            return self._fail(req, req.num_computed_tokens, f"emitting its output failed ({type(e).__name__}: {e})")

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
        bm = self.block_manager
        return [bm.num_slots(r.request_id) - r.num_computed_tokens for r in self.scheduler.running]

    @property
    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            num_steps=self.num_steps, num_preemptions=sch.num_preemptions,
            prefix_cache_queries=bm.stats.prefix_queries, prefix_cache_hits=bm.stats.prefix_hits,
            prefix_cache_evictions=bm.stats.evictions, num_shared_blocks=bm.num_shared_blocks(),
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_usable_blocks, kv_waste_slots=sum(self.kv_waste()),
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            num_batched_tokens=self.num_batched_tokens,
            num_generated_tokens=self.num_generated_tokens,
            spec_proposed=self.spec["proposed"], spec_accepted=self.spec["accepted"],
            spec_verify_steps=self.spec["verify_steps"], spec_rows=self.spec["rows"], spec_emitted=self.spec["emitted"],
            spec_off_steps=sch.num_spec_off_steps, spec_drafter_failures=self.spec["drafter_failures"],
            kv_bytes=self.kv_bytes, kv_bytes_dense=self.kv_bytes_dense,
            routed_blocks=bm.routed[0].num_usable_blocks if isinstance(bm, RoutedBlockManager) and bm.routed else 0,
            routed_blocks_in_use=tuple(bm.routed_blocks_in_use()) if isinstance(bm, RoutedBlockManager) else ())

    def stats_dict(self) -> dict:
        st = self.stats
        return {**dataclasses.asdict(st), "acceptance_rate": st.acceptance_rate,
                "mean_accepted_length": st.mean_accepted_length, "kv_bytes_saved": st.kv_bytes_saved}
