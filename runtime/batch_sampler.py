"""Sampling a whole step at once: one token per row, non-finite rows flagged on the device, and the requested
log-probabilities, all brought to the host in one copy. A row whose sampling fails is reported, not raised, so the
engine can end that request alone.

failure_text is the one way the runtime turns an exception into such a per-request error: a KilnError is the
request's own doing and its message is enough; anything else is a bug in kiln, logged once with its traceback
(`kiln.runtime`) so that it is not reduced to the one line the request's error carries."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.runtime.logprob import PositionLogprobs, position_logprobs
from kiln.runtime.sampler import TokenHistory, sample_rows, to_device
from kiln.runtime.sampling_params import SamplingParams

log = logging.getLogger("kiln.runtime")


def failure_text(what: str, e: Exception) -> str:
    """`what` ("sampling failed", ...) and `e` as a request's error text: "what (TypeError: message)". The caller
    isolates the failure (the request, or the step's rows, end with an error; the engine goes on); an `e` that is
    not a KilnError is a bug in kiln, logged here with its traceback, which the text alone would lose."""
    text = f"{what} ({type(e).__name__}: {e})"
    if not isinstance(e, KilnError):
        log.error("%s; this is a bug in kiln, isolated to the requests concerned (the engine goes on)", text,
                  exc_info=e)
    return text


@dataclass
class BatchSample:
    """The outcome of sample_batch: a token per row, and per row None or why it could not be sampled.

    logprobs: per row None (not asked) or {token_id: Logprob} in vLLM v1's order: the sampled token first (so it
    is always present), then the top-k by rank, each with its rank (decoded_token is filled when the request's
    output is made, Request.make_output).
    """

    tokens: list[int]
    errors: list[str | None]
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.logprobs:  # built without logprobs: no row asked
            self.logprobs = [None] * len(self.tokens)


NONFINITE_LOGITS = ("the model produced NaN or inf logits for this request; likely causes: fp16 overflow (try "
                    "dtype bf16 or fp32), non-finite weights in the checkpoint, or an extreme spec or config value (a "
                    "norm eps, rope theta, a scale); run `kiln check` on the spec and check the checkpoint for NaN/inf")


def nonfinite_rows(rows: torch.Tensor) -> torch.Tensor:
    """bool [R]: rows of [R, V] logits that cannot be sampled. -inf entries are legitimate (masked tokens); NaN,
    +inf or a row of nothing but -inf are not: exactly the rows whose max is not finite (max propagates NaN)."""
    return ~rows.amax(dim=-1).isfinite()


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prev_tokens: Sequence[TokenHistory | Sequence[int]],
) -> BatchSample:
    """One token per row of [R, V] logits, each row with its own request's parameters and generator. prev_tokens:
    per row a TokenHistory (what the penalties and min_tokens read), or the tokens seen so far (see sample_rows).

    Greedy rows whose logits no penalty, logit_bias or min_tokens changes share one argmax; every other row is
    drawn alone with its own generator, so a seeded request gives the same tokens whatever else is in the batch.
    Every row's token and its finite flag stay on the device until one host copy at the end (the tokens are
    needed there anyway). A row whose logits are not finite, or whose sampling raises, gets an error instead of a
    token; the others are unaffected.

    Rows whose params ask for logprobs also get log-probabilities, reported as vLLM v1 does: from the raw model
    distribution, log_softmax of the logits before logit_bias, penalties, temperature and top-k/p filtering. They
    are computed batched for just those rows and ride in the same host copy, so other rows pay nothing.

    It is launch_batch(...).result(): the engine calls the two halves apart, to do host work in between.
    """
    return launch_batch(logits, params, generators, prev_tokens).result()


@dataclass
class LaunchedSample:
    """sample_batch's device work, queued (asynchronous on CUDA), and its one device -> host copy.

    On CUDA the copy is queued at once, into pinned memory, with an event behind it: result() waits for that event
    only. Reading the device tensor in result() instead (.tolist()) would queue the copy then, behind whatever was
    launched in between; under async scheduling that is the whole next step, and the host would wait for it."""

    packed: torch.Tensor | None  # everything the host needs, in one tensor (None: no rows)
    errors: list[str | None]  # rows whose sampling raised while launching
    unpack: Callable[[list], tuple[list[int], list[int], list[PositionLogprobs | None]]]
    # The sampled ids on the device (int64 [R]; None: no rows), which a step launched before this one's host copy
    # takes its input tokens from (the engine's async scheduling). A row that cannot be sampled holds a dummy id.
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = field(default=None, init=False)  # packed's host copy (the tensor itself off CUDA)
    copied: torch.cuda.Event | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.packed is not None:
            self.host, self.copied = queue_host_copy(self.packed)

    def result(self) -> BatchSample:
        if self.host is None:
            return BatchSample([], self.errors, [])
        if self.copied is not None:
            self.copied.synchronize()
        tokens, ok_flags, logprobs = self.unpack(self.host.tolist())  # the step's one device -> host copy
        errors = self.errors
        for i, ok in enumerate(ok_flags):
            if not ok and errors[i] is None:
                errors[i] = NONFINITE_LOGITS
        return BatchSample(tokens, errors, logprobs)


def queue_host_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """t's copy to the host, queued now: on CUDA into pinned memory with an event recorded behind it (synchronize
    it before reading the copy: that waits for this copy only, not for work launched after it); t itself elsewhere."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event


def launch_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prev_tokens: Sequence[TokenHistory | Sequence[int]],
) -> LaunchedSample:
    """sample_batch's tensor work without its host copy: on CUDA nothing here waits for the device."""
    rows = logits.float()
    n = rows.shape[0]
    errors: list[str | None] = [None] * n
    if n == 0:
        return LaunchedSample(None, errors, _unpack_plain)
    # One reduction gives every plain greedy row's token and the finite flags (a row's max is not finite exactly
    # when nonfinite_rows flags it); a row that cannot be sampled gets token 0, its argmax once zeroed below.
    best, argmax = rows.max(dim=-1)
    finite = best.isfinite()
    argmax = torch.where(finite, argmax, 0)
    toks = argmax
    # argmax alone serves a greedy row unless its logits are processed first (penalties, logit_bias, min_tokens)
    direct = [p.greedy and not p.processes_logits(h.num_output if isinstance(h, TokenHistory) else 0)
              for p, h in zip(params, prev_tokens, strict=True)]
    plain = all(direct)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if plain and not asked:  # the usual decode batch: nothing reads the rows again
        return LaunchedSample(torch.stack([toks, finite.long()]), errors, _unpack_plain, toks)
    rows = rows.masked_fill(~finite[:, None], 0.0)  # never feed NaN to multinomial (a device assert on CUDA)
    if not plain:
        parts: list[torch.Tensor] = []
        for i, p in enumerate(params):
            try:
                parts.append(argmax[i : i + 1] if direct[i] else sample_rows(rows[i : i + 1], p, generators[i],
                                                                             [prev_tokens[i]]))
            except Exception as e:  # one request's failure must not take down the batch
                errors[i] = f"{failure_text('sampling failed', e)} with {p}"
                parts.append(argmax[i : i + 1])
        toks = torch.cat(parts)
    if not asked:
        return LaunchedSample(torch.stack([toks, finite.long()]), errors, _unpack_plain, toks)
    packed, unpack = _with_logprobs(rows, toks, finite, params, asked)
    return LaunchedSample(packed, errors, unpack, toks)


def _unpack_plain(host: list) -> tuple[list[int], list[int], list[PositionLogprobs | None]]:
    tokens, ok_flags = host
    return tokens, ok_flags, [None] * len(tokens)


def _with_logprobs(rows: torch.Tensor, toks: torch.Tensor, finite: torch.Tensor, params: Sequence[SamplingParams],
                   asked: list[int]) -> tuple[torch.Tensor, Callable]:
    """Tokens, finite flags and the asked rows' logprobs packed into one float64 device tensor (token ids < 2**53
    are exact in float64), and the function that unpacks its host copy."""
    n, m = rows.shape[0], len(asked)
    k = min(max(params[i].logprobs for i in asked), rows.shape[-1])  # one topk for all asked rows
    idx = torch.tensor(asked, dtype=torch.long) if m < n else None
    sub_rows = rows if idx is None else rows.index_select(0, to_device(idx, rows.device))
    sub_toks = toks if idx is None else toks.index_select(0, to_device(idx, rows.device))
    logp = sub_rows.log_softmax(dim=-1)
    own = logp.gather(-1, sub_toks[:, None])
    # the sampled token's rank as vLLM counts it: the tokens at least as likely
    parts = [toks.double(), finite.double(), own.squeeze(-1).double(), (logp >= own).sum(-1).double()]
    if k > 0:
        top = logp.topk(k, dim=-1)
        parts += [top.values.double().flatten(), top.indices.double().flatten()]

    def unpack(host: list[float]) -> tuple[list[int], list[int], list[PositionLogprobs | None]]:
        tokens = [int(t) for t in host[:n]]
        ok_flags = [int(f) for f in host[n : 2 * n]]
        sampled_lp, sampled_rank = host[2 * n : 2 * n + m], host[2 * n + m : 2 * n + 2 * m]
        vals = host[2 * n + 2 * m : 2 * n + 2 * m + m * k]
        ids = host[2 * n + 2 * m + m * k :]
        logprobs: list[PositionLogprobs | None] = [None] * n
        for j, i in enumerate(asked):
            top = ((int(ids[j * k + r]), vals[j * k + r]) for r in range(min(params[i].logprobs, k)))
            logprobs[i] = position_logprobs(tokens[i], sampled_lp[j], int(sampled_rank[j]), top)
        return tokens, ok_flags, logprobs

    return torch.cat(parts), unpack
