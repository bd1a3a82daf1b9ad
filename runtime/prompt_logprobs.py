"""vLLM's prompt_logprobs: each prompt token's log-probability (after the first), from the logits of the position
before it, with the k most likely tokens there and the prompt token's rank.

Which rows. For a chunk [start, start + num_new) of a request whose prompt is not all scored, the rows of positions
j in [first unscored, min(start + num_new, len(prompt) - 1)) join the step's sample_indices after the sampled rows
(ModelRunner.execute hands their logits back apart, in the model's dtype), so every position is computed once:
across chunks (a chunk's last row scores the next chunk's first prompt token, which is known), across preemption
(the recompute starts scoring where the request's list ends) and across prefix-cache hits (Request.prefix_cache_tokens
never lets a match skip a position still to be scored). The prompt's last row stays the sampled row, as before.

The work. log_softmax in fp32 over blocks of at most BLOCK_ELEMENTS logits (only a block's fp32 copy lives at once,
beside the step's own logits), the prompt token's value and rank (as vLLM counts it: the tokens at least as likely)
and the top k, packed into one tensor and copied to the host once, like the sampler's (launch_prompt). take_prompt
appends them to the requests: a row whose logits are not finite fails its request alone, with the sampler's message.

A step with such rows is taken in where it is launched, never left in flight by async scheduling (Engine.step,
Scheduler.schedule_ahead): the entries are in the request before its first output is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.runtime.batch_sampler import NONFINITE_LOGITS, failure_text, queue_host_copy
from kiln.runtime.logprob import position_logprobs
from kiln.runtime.outputs import Made, OutputMaker
from kiln.runtime.sampler import to_device
from kiln.runtime.schedule import ScheduledSeq

BLOCK_ELEMENTS = 1 << 24  # logits per block of rows taken to fp32 at once (64 MiB); at least one row


@dataclass
class PromptChunk:
    seq: ScheduledSeq
    first: int  # the first position scored: its logits score prompt token first + 1
    count: int  # positions first .. first + count - 1, rows of the step one after another


@dataclass
class PromptRows:
    """A step's rows that score prompt tokens, chunk by chunk."""

    chunks: list[PromptChunk]
    rows: list[int]  # rows of the flat batch (sample_indices after the sampled rows)
    targets: list[int]  # the prompt token each row scores
    logits: torch.Tensor | None = field(default=None, repr=False)  # [len(rows), vocab], set by ModelRunner.execute


def prompt_rows(seqs: Sequence[ScheduledSeq]) -> PromptRows | None:
    """The step's prompt-scoring rows, in the general layout (chunks back to back, in order); None when none."""
    chunks, rows, targets = [], [], []
    q = 0
    for s in seqs:
        req = s.request
        j = req.unscored_from
        if j is not None:
            assert s.start <= j, f"{req.request_id}: chunk from {s.start} skips prompt position {j}"
            end = min(s.start + s.num_new, len(req.prompt_token_ids) - 1)
            if j < end:
                chunks.append(PromptChunk(s, j, end - j))
                rows += range(q + j - s.start, q + end - s.start)
                targets += req.prompt_token_ids[j + 1 : end + 1]
        q += s.num_new
    return PromptRows(chunks, rows, targets) if chunks else None


@dataclass
class LaunchedPrompt:
    """launch_prompt's device work, queued, and its one host copy (see LaunchedSample)."""

    k: int  # top entries computed per row (the most any chunk's request asked, at most the vocabulary)
    host: torch.Tensor
    copied: torch.cuda.Event | None

    def values(self) -> list[float]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def launch_prompt(prompt: PromptRows) -> LaunchedPrompt | str:
    """The device work for a step's prompt rows, or why it failed (then every chunk's request fails)."""
    try:
        logits = prompt.logits
        n, vocab = logits.shape
        k = min(max(c.seq.request.params.prompt_logprobs for c in prompt.chunks), vocab)
        targets = to_device(torch.tensor(prompt.targets), logits.device)[:, None]
        step = max(1, BLOCK_ELEMENTS // vocab)
        parts: list[list[torch.Tensor]] = [[], [], [], [], []]
        for a in range(0, n, step):
            x = logits[a : a + step].float()
            logp = x.log_softmax(dim=-1)
            own = logp.gather(-1, targets[a : a + step])
            got = [own.squeeze(-1), (logp >= own).sum(-1), x.amax(dim=-1).isfinite()]  # max: see nonfinite_rows
            if k:
                top = logp.topk(k, dim=-1)
                got += [top.values.flatten(), top.indices.flatten()]
            for p, t in zip(parts, got, strict=False):
                p.append(t.double())
        packed = torch.cat([torch.cat(p) for p in parts if p])
        return LaunchedPrompt(k, *queue_host_copy(packed))
    except Exception as e:  # not one row's fault: this step's prompt rows are lost, not the engine
        return failure_text("scoring the prompt failed", e)


def take_prompt(output: OutputMaker, prompt: PromptRows, launched: LaunchedPrompt | str, made: Made) -> None:
    """Append each chunk's entries to its request's prompt_logprobs (Logprob objects); a chunk whose rows are
    not finite, or a launch that failed, fails its request (its output goes into `made`)."""
    err = launched if isinstance(launched, str) else None  # a failed launch, logged there (failure_text)
    if err is None:
        try:
            host = launched.values()
        except Exception as e:
            err = failure_text("scoring the prompt failed", e)
    if err is not None:
        for c in prompt.chunks:
            if not c.seq.request.status.done:
                made.append(output.fail(c.seq.request, c.seq.start, err))
        return
    n, k = len(prompt.rows), launched.k
    own, ranks, ok, vals, ids = host[:n], host[n : 2 * n], host[2 * n : 3 * n], host[3 * n : 3 * n + n * k], \
        host[3 * n + n * k :]
    r = 0
    for c in prompt.chunks:
        req, rows = c.seq.request, range(r, r + c.count)
        r += c.count
        if req.status.done:  # ended while this step ran (its previous output failed)
            continue
        if not all(ok[i] for i in rows):
            made.append(output.fail(req, c.seq.start, NONFINITE_LOGITS))
            continue
        assert req.num_prompt_scored == c.first + 1, f"{req.request_id}: prompt position {c.first} scored twice"
        want, text = min(req.params.prompt_logprobs, k), req.detokenizer.token_str
        for i in rows:  # vLLM v1's order: the prompt token first (always present, with its own rank), then the top
            top = ((int(ids[i * k + t]), vals[i * k + t]) for t in range(want))
            req.prompt_logprobs.append(position_logprobs(prompt.targets[i], own[i], int(ranks[i]), top, text))
        req.num_prompt_scored += len(rows)
