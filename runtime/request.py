"""Request state inside the engine, and the outputs the engine hands back (vLLM's shape).

A request's KV lives in the block manager under its request id; here is only what the scheduler and the
sampler need: the tokens known so far (prompt + generated), how many of them are in the cache, the status,
the per-request generator, the incremental detokenizer and the timings.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.logprob import PositionLogprobs
from kiln.runtime.prompt_limits import truncate_prompt  # noqa: F401  (re-exported)
from kiln.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was freed and will be recomputed
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def done(self) -> bool:
        return self in DONE  # a module constant: building the tuple from the enum class costs 4x the test


DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED)  # `status in DONE` is status.done without the call


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled (vLLM's)
    num_draft_tokens: int = 0  # speculative decoding: tokens a drafter proposed for this request
    # of those, accepted by verification (as vLLM counts them: drafts after a stop token that ended the request
    # count too, though the stop drops them from the output)
    num_accepted_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot_s(self, num_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finish_time is None or num_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_tokens - 1)


@dataclass(eq=False)  # a request is itself: queues find and remove it by identity, not by comparing every field
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None = None
    arrival_order: int = 0  # ties on arrival_time are broken by this; lower is higher priority
    output_token_ids: list[int] = field(default_factory=list)
    # with params.logprobs set: one {token_id: Logprob} per output token (see batch_sampler.sample_batch; their
    # decoded_token is filled by make_output)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs set: None, then one {token_id: Logprob} per prompt position scored so far (see
    # runtime/prompt_logprobs.py); None otherwise (set in __post_init__)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    status: RequestStatus = RequestStatus.WAITING
    # Speculative decoding: tokens proposed this step, at positions num_tokens.. (token_slice covers them); they
    # are cleared once verified, and never part of the output unless accepted.
    draft_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it failed (finish_reason "error"), or a problem met while finishing it
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    # How much the last RequestOutput already carried (for deltas; with final_only, the tokens made before the
    # last step, see skip_output).
    _sent_tokens: int = 0
    _sent_text: int = 0
    _text: str = ""  # the text the last RequestOutput carried
    _lp_count: int = 0  # output tokens summed into _lp_sum (cumulative_logprob) and their entries' text filled
    _lp_sum: float = 0.0
    _sent_prompt: bool = False  # an output carried prompt_logprobs (a delta output carries them once, as vLLM's)
    # Prompt positions scored (the first has nothing before it), counted apart from prompt_logprobs, a list that
    # outputs share with callers: one who edits it cannot make a position be scored again.
    num_prompt_scored: int = 1

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token has nothing before it
        # The detokenizer keeps special tokens' text as the params ask (a new one, before its first token).
        self.detokenizer.configure(self.params.skip_special_tokens, self.params.spaces_between_special_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_text_tokens(self) -> int:
        """Output tokens whose text is in the output: all but a stop token (eos or stop_token_ids) that ended the
        request, as in vLLM, unless params.include_stop_str_in_output."""
        n = len(self.output_token_ids)
        by_token = self.finish_reason == "stop" and type(self.stop_reason) is int
        if by_token and not self.params.include_stop_str_in_output:
            return n - 1
        return n

    @property
    def reported_stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop_token_ids id that ended the request; None for eos (which
        stop_reason records internally, for num_text_tokens), a length, an abort or an error."""
        r = self.stop_reason
        return None if type(r) is int and r not in self.params.stop_token_ids else r

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def unscored_from(self) -> int | None:
        """With prompt_logprobs: the first position whose logits (which score the prompt token after it) are still to
        be computed; None when there is none (not asked, or every prompt position scored)."""
        if self.prompt_logprobs is None or self.num_prompt_scored >= len(self.prompt_token_ids):
            return None
        return self.num_prompt_scored - 1

    def prefix_cache_tokens(self) -> list[int]:
        """The tokens a prefix-cache match may cover: all of them, but while prompt positions are still to be scored,
        none past the first of them (BlockManager.match_prefix leaves the last token it is given to compute), so
        their logits are computed rather than skipped."""
        j = self.unscored_from
        return self.all_token_ids if j is None else self.prompt_token_ids[: j + 1]

    @property
    def priority(self) -> tuple[float, int]:
        return (self.metrics.arrival_time, self.arrival_order)

    @property
    def can_speculate(self) -> bool:
        """Whether a drafter may propose for this request: not opted out (params.speculate; by default seeded
        sampling is), and no logprobs, penalty (repetition, presence, frequency), logit_bias or allowed_token_ids,
        whose per-position
        processing the verification does not reproduce, nor fewer outputs than min_tokens (its mask moves with
        each draft position; once min_tokens is reached there is nothing to reproduce and it speculates)."""
        p = self.params
        if p.speculate is False or p.logprobs is not None or p.reads_history or p.logit_bias:
            return False
        if p.allowed_token_ids is not None:  # a mask the verification does not apply either
            return False
        if len(self.output_token_ids) < p.min_tokens:
            return False
        return p.speculate or p.seed is None or p.greedy  # None: not seeded sampling (see SamplingParams.speculate)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output (+ this step's drafts) without building the whole list."""
        n = self.num_tokens
        if stop > n:  # drafts sit right after the known tokens
            head = self.token_slice(start, n) if start < n else []
            return head + self.draft_tokens[max(start - n, 0) : stop - n]
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def make_output(self, text_failed: bool = False) -> RequestOutput:
        """The request's output now, shaped by params.output_kind: everything so far plus what is new since the
        previous output (cumulative), only what is new (delta), or everything, all of it new (final_only, made
        once, when the request ends).

        A request that failed keeps the text already sent (its detokenizer may be what failed), so the deltas a
        stream received still add up to the final text; with final_only nothing was sent, and it keeps the text
        its detokenizer made.
        """
        kind = self.params.output_kind
        final_only = kind == "final_only"
        failed = text_failed or self.finish_reason == "error"
        det = self.detokenizer
        if failed:
            text = det.visible_text(final=True) if final_only else self._text
        else:
            text = det.visible_text(final=self.status in DONE)
        sent_tokens, sent_text = (0, 0) if final_only else (self._sent_tokens, self._sent_text)
        ids = self.output_token_ids
        new_ids, new_text = ids[sent_tokens:], text[sent_text:]
        asked = self.params.logprobs is not None
        cumulative = self._settle_logprobs() if asked else None
        new_lps = self.output_logprobs[sent_tokens:] if asked else None
        if kind == "delta":  # only what is new: no copy of the whole output per step
            all_ids, all_text, all_lps = new_ids, new_text, new_lps
        else:
            all_ids, all_text, all_lps = list(ids), text, list(self.output_logprobs) if asked else None
        out = CompletionOutput(index=0, token_ids=all_ids, text=all_text, finish_reason=self.finish_reason,
                               stop_reason=self.reported_stop_reason, delta_token_ids=new_ids, delta_text=new_text,
                               logprobs=all_lps, delta_logprobs=new_lps,
                               cumulative_logprob=cumulative)
        self._sent_tokens, self._sent_text, self._text = len(ids), len(text), text
        # Shared, not copied: complete before the first token, they never change after it.
        prompt_lps = None
        if self.prompt_logprobs is not None and (kind != "delta" or not self._sent_prompt):
            prompt_lps, self._sent_prompt = self.prompt_logprobs, True
        # The prompt's list is shared, not copied (it never changes; a copy cost O(prompt) per request per step).
        metrics = object.__new__(RequestMetrics)  # a field-for-field snapshot, without __init__'s argument binding
        metrics.__dict__.update(self.metrics.__dict__)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [out], self.status in DONE, metrics,
                             self.error, prompt_lps)

    def _settle_logprobs(self) -> float:
        """The new output tokens' entries get their text (decoded_token), once each, here rather than when sampled:
        output work, which overlap_outputs hides behind the next step. Returns the cumulative logprob."""
        lps, ids = self.output_logprobs, self.output_token_ids
        if self._lp_count > len(lps):  # a failed step's tokens were rolled back: sum again
            self._lp_count, self._lp_sum = 0, 0.0
        text = self.detokenizer.token_str  # never raises: a token whose text fails to decode gets None
        for i in range(self._lp_count, len(lps)):
            d = lps[i]
            for t, lp in d.items():
                lp.decoded_token = text(t)
            self._lp_sum += d[ids[i]].logprob
        self._lp_count = len(lps)
        return self._lp_sum

    def skip_output(self) -> None:
        """A final_only request that is still running makes no output this step. Its tokens so far count as
        carried: a later failure rolls back only the tokens that come after them (OutputMaker.fail)."""
        self._sent_tokens = len(self.output_token_ids)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # every generated token so far (a stop token that ended generation included)
    text: str  # their text; a stop string that ended generation is trimmed
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    delta_token_ids: list[int] = field(default_factory=list)  # new since the previous output of this request
    delta_text: str = ""
    # None unless the request asked for logprobs; then, as vLLM v1's, one {token_id: Logprob} per token of token_ids:
    # the sampled token first, then the top-k by rank (the sampled one keeps its first place when it is among them;
    # kiln.runtime.logprob.top_logprobs gives the top-k alone), from the model's raw log_softmax (before temperature)
    logprobs: list[PositionLogprobs] | None = None
    delta_logprobs: list[PositionLogprobs] | None = None  # those of delta_token_ids
    cumulative_logprob: float | None = None  # with logprobs: the sum of every output token's log-probability so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the request's own list, shared by all its outputs: read it, do not change it
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # with finish_reason "error": what failed and the likely cause
    # With SamplingParams.prompt_logprobs (vLLM v1's shape): None for the first prompt token, then per prompt token
    # {token_id: Logprob} of the model's raw log_softmax at that position: the prompt token first (always present,
    # with its own rank), then the top k by rank. A "delta" output carries them once, on its first output. The
    # request's own list, like prompt_token_ids: read it, do not change it.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's RequestOutput.num_cached_tokens: prompt tokens found in the prefix cache when the request was first
        scheduled, kept through preemption (metrics'; with n > 1, LLM reports the choice that finished last, as
        vLLM does)."""
        return self.metrics.num_cached_tokens
