"""Speculative decoding in the runtime: drafters that propose tokens, and the verification of a step's drafts.

For a decode-ready request the scheduler reserves 1 + up to k slots; a drafter fills them with d_1..d_n; the
target runs [last token, d_1..d_n] as one chunk with every row sampled; the model's verifier (kiln::spec_verify
or its kernel) accepts a prefix d_1..d_a and draws the next token so that the output distribution is exactly
the target's (Leviathan et al. 2023). Both p (target) and q (draft) are sampler.processed_probs, the very
distribution the ordinary sampler draws from, so temperature, top-k, top-p and min-p apply to both alike.

- NgramDrafter: prompt lookup over prompt + output; deterministic (q is one-hot, draft_probs None).
- ModelDrafter: a second step model (a draft model with its own KV pool over the same block tables, or the
  target's first L layers sharing the target's cache: the self drafter), run autoregressively for k steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.runtime.batch_sampler import nonfinite_rows
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampler import processed_probs
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.step import KVCache, StepModel, Verifier, VerifyBatch, kv_bytes_per_block

# Speculate only while at most this many decodes run. Measured by bench/speculative.py on the development CPU, on an
# otherwise idle machine (bench/results/speculative-smollm2-135m-cpu--x86-64--2-threads-2026-11-24.json,
# "crossover"): with SmolLM2-135M the n-gram drafter beat plain decoding at every batch measured (3.0x at 1, 1.1x at
# 8, 1.35x at 32 on a copying prompt); the self drafter (8 of 30 layers, ~1% of drafts accepted) lost at every batch.
# The default follows the drafter that pays, up to the largest batch measured; a GPU should measure its own
# crossover, and Engine(speculation_max_batch=...) overrides this.
DEFAULT_SPECULATION_MAX_BATCH = 32


@dataclass
class Draft:
    tokens: list[int]  # d_1..d_n, n <= the slots the scheduler reserved
    probs: torch.Tensor | None  # fp32 [n, V]: q_j each d_j was drawn from; None for a deterministic drafter


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens (n, then n - 1, ... 1)
    in prompt + output and propose the up-to-k tokens that followed it. It has no context of its own (`context`
    None, as ModelDrafter's for a draft as long as the target).

    Each request's tokens are kept in a numpy array that grows with them (a request's tokens only grow while it
    can be proposed for), so a proposal costs a vectorized search, not a Python loop over the whole context per
    step: at 2048 tokens about 0.2 ms per request before, which at batch 32 was several times the model step."""

    def __init__(self, n: int = 3, k: int = 4):
        if not (isinstance(n, int) and n >= 1 and isinstance(k, int) and k >= 1):
            raise KilnError(f"NgramDrafter(n={n!r}, k={k!r}): n and k must be integers >= 1 (e.g. n=3, k=4)")
        self.n, self.k, self.context = n, k, None
        # per request (dropped with it): a buffer of its tokens and how many of them are written
        self._tokens: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def bind(self, target: StepModel, bm: BlockManager, cache: KVCache, *, max_num_seqs: int,
             max_model_len: int, max_num_batched_tokens: int | None = None, **padding: object) -> None:
        pass

    def propose(self, seqs: Sequence[ScheduledSeq]) -> list[Draft]:
        out = []
        for s in seqs:
            toks = ngram_lookup(self.tokens_of(s.request), self.n, s.num_drafts)
            s.request.draft_tokens = toks
            out.append(Draft(toks, None))
        return out

    def tokens_of(self, req: Request) -> np.ndarray:
        """req's prompt + output tokens as an int64 array, appending only what came since the last call."""
        total = req.num_tokens
        buf, n = self._tokens.get(req, (None, 0))
        if buf is None or n > total:  # new (or, never expected, shorter): start over
            buf, n = np.empty(max(2 * total, 64), dtype=np.int64), 0
        if total > buf.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if total > n:
            buf[n:total] = req.token_slice(n, total)
        self._tokens[req] = (buf, total)
        return buf[:total]

    def verified(self, req: Request, start: int, num_drafts: int, num_accepted: int) -> None:
        pass


def ngram_lookup(tokens: np.ndarray, n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last m tokens, m = n .. 1 (the
    occurrence may overlap the tail but must be followed by at least one token)."""
    total = tokens.shape[0]
    for m in range(min(n, total - 1), 0, -1):
        last = total - m - 1  # the latest start whose match leaves a token after it
        hit = tokens[: last + 1] == tokens[total - m]
        for j in range(1, m):
            hit &= tokens[j : last + 1 + j] == tokens[total - m + j]
        starts = np.flatnonzero(hit)
        if starts.size:
            i = int(starts[-1])
            return tokens[i + m : i + m + k].tolist()
    return []


class ModelDrafter:
    """Drafts with a step model: k autoregressive steps over the speculative sequences, each d_j drawn from
    q_j = processed_probs(draft logits) with the request's own generator.

    shares_target_cache=True (the self drafter): the draft has L <= the target's layers with its kv dtype, kv heads
    and head dim, and uses layers [0, L) of the target's cache, which always holds what the draft needs up to the
    target's computed tokens. False: its own pool (one block per target block, same block size) addressed by the
    same block tables; per request it tracks how many tokens that pool holds and computes the rest first (the
    whole prompt on a request's first speculative step; 0 again after preemption). That catch-up is bounded by the
    engine's token budget (max_num_batched_tokens) per step: a request further behind catches up a chunk and
    decodes without drafts this step, so a long prompt never makes one step's draft work unbounded.

    context: the draft model's, when shorter than the target's. A sequence is drafted only while the positions its
    drafts are made at fit it (vLLM's Top1Proposer also leaves out sequences past the draft's max length, one token
    earlier); longer ones decode
    without drafts, neither caught up nor drafted, since the draft has no positions for them (learned positions
    would index past their table; rope would run past what the draft was made for). None: no bound of its own.
    """

    def __init__(self, step_model: StepModel, k: int = 4, *, shares_target_cache: bool = False,
                 context: int | None = None):
        if not (isinstance(k, int) and k >= 1):
            raise KilnError(f"ModelDrafter(k={k!r}): k must be an integer >= 1 (e.g. 4)")
        if context is not None and (isinstance(context, bool) or not (isinstance(context, int) and context >= 1)):
            raise KilnError(f"ModelDrafter(context={context!r}): the draft model's context must be an integer >= 1, "
                            "or None for no bound")
        self.model, self.k, self.shares, self.context = step_model, k, shares_target_cache, context
        self.runner: ModelRunner | None = None
        self.cached: dict[str, int] = {}  # own pool: tokens of each request whose draft K/V is written
        self.catchup_budget: int | None = None  # own pool: prompt tokens the draft may catch up per step (bind)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0 if self.shares else kv_bytes_per_block(self.model, block_size)

    def bind(self, target: StepModel, bm: BlockManager, cache: KVCache, *, max_num_seqs: int,
             max_model_len: int, max_num_batched_tokens: int | None = None, use_cuda_graphs: bool = False,
             pad_decode_batches: bool = False, max_batch: int | None = None) -> None:
        """Check the draft against the target and make its runner. use_cuda_graphs / pad_decode_batches: as the
        target's runner, so the draft's decode steps are padded (and replayed from graphs) the same way; max_batch:
        the most sequences that speculate at once (the engine's speculation_max_batch), which bounds its graphs."""
        d = self.model
        self.catchup_budget = max_num_batched_tokens
        if d.vocab != target.vocab:
            raise KilnError(f"the draft model's vocabulary ({d.vocab} tokens) differs from the target's "
                            f"({target.vocab}); a drafter must share the target's tokenizer")
        view = None
        if self.shares:
            got = (d.kv_dtype, d.num_kv_heads, d.head_dim)
            want = (target.kv_dtype, target.num_kv_heads, target.head_dim)
            if d.num_layers > target.num_layers or got != want:
                raise KilnError(
                    f"a self drafter sharing the target's KV cache needs at most {target.num_layers} layers and the "
                    f"target's kv dtype, kv heads and head dim {want}; it has {d.num_layers} layers and {got}. "
                    "Build it from the target's spec with layers = L, or use shares_target_cache=False")
            view = KVCache(cache.data[: d.num_layers], None if cache.scales is None else cache.scales[: d.num_layers])
        seqs = max_num_seqs if max_batch is None else max(1, min(max_batch, max_num_seqs))
        self.runner = ModelRunner(d, bm, max_num_seqs=seqs, max_model_len=max_model_len, kv_cache=view,
                                  use_cuda_graphs=use_cuda_graphs, pad_decode_batches=pad_decode_batches)
        bm.on_free.append(self._forget)

    def _forget(self, request_id: str) -> None:
        self.cached.pop(request_id, None)

    def propose(self, seqs: Sequence[ScheduledSeq]) -> list[Draft]:
        assert self.runner is not None, "ModelDrafter.bind was not called (the Engine does it)"
        reqs = [s.request for s in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for r in reqs:
            r.draft_tokens = []
        drafting, first, caught_up = self._first_step(seqs)
        for j in range(max((seqs[i].num_drafts for i in drafting), default=0)):
            active = [i for i in drafting if seqs[i].num_drafts > j]
            if j == 0:
                sched = first
            else:
                sched = Schedule([ScheduledSeq(seqs[i].request, seqs[i].start + j, 1, True) for i in active])
            logits, _ = self.runner.execute(sched)
            q = processed_probs(logits, [reqs[i].params for i in active])
            toks = draw(q, [reqs[i] for i in active]).tolist()
            for row, i in enumerate(active):
                reqs[i].draft_tokens.append(toks[row])
                probs[i].append(q[row])
        if not drafting and first.seqs:  # only catch-up chunks this step
            self.runner.execute(first)
        self.cached.update(caught_up)  # only now: a failed step leaves the draft's bookkeeping as it was
        return [Draft(list(r.draft_tokens), torch.stack(p) if p else None) for r, p in zip(reqs, probs, strict=True)]

    def _first_step(self, seqs: Sequence[ScheduledSeq]) -> tuple[list[int], Schedule, dict[str, int]]:
        """The sequences that draft this step, and the draft's first step: for each of them, everything the draft
        has not cached up to and including the last known token (sampled); within the catch-up budget, so a
        sequence further behind gets an unsampled chunk of its missing tokens instead and no drafts (the third
        result: its draft-cached length once the step has run)."""
        drafting, first, caught_up = [], Schedule(), {}
        budget = self.catchup_budget
        for i, s in enumerate(seqs):
            if not self.fits(s):
                continue  # past the draft's context: a plain decode, this step and every later one
            rid = s.request.request_id
            c = s.start if self.shares else min(self.cached.get(rid, 0), s.start)
            need = s.start + 1 - c
            if budget is None or need <= max(budget, 1):
                drafting.append(i)
                first.seqs.append(ScheduledSeq(s.request, c, need, True))
                budget = None if budget is None else budget - need
            elif budget > 0:  # catch up a chunk (never the last known token: that one is sampled when drafting)
                m = min(budget, need - 1)
                first.seqs.append(ScheduledSeq(s.request, c, m, False))
                caught_up[rid] = c + m
                budget -= m
        return drafting, first, caught_up

    def fits(self, s: ScheduledSeq) -> bool:
        """Whether drafting s fits the draft's context: the draft model is fed positions up to s.start + num_drafts - 1
        (the last known token, then every draft but the last), so those must be below it."""
        return self.context is None or s.start + s.num_drafts <= self.context

    def verified(self, req: Request, start: int, num_drafts: int, num_accepted: int) -> None:
        """The draft cache holds positions up to start + n - 1; those up to start + a are still valid."""
        if not self.shares and num_drafts:
            self.cached[req.request_id] = min(start + num_drafts, start + 1 + num_accepted)


def draw(probs: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """One token per row of processed probabilities: the argmax for greedy rows, else a draw with the request's
    generator (so a seeded request's drafts do not depend on its batch)."""
    toks = probs.argmax(dim=-1)
    if all(r.params.greedy for r in reqs):
        return toks
    parts = [toks[i : i + 1] if r.params.greedy else torch.multinomial(probs[i], 1, generator=r.generator)
             for i, r in enumerate(reqs)]
    return torch.cat(parts)


@dataclass
class SpecRow:
    """One speculative decode of the step: its sequence, the first of its 1 + n logit rows, and its draft."""

    seq: ScheduledSeq
    row: int
    draft: Draft


def verify_rows(verifier: Verifier, logits: torch.Tensor, items: Sequence[SpecRow]) -> list[tuple[int, int, bool]]:
    """(accepted count a, next token, logits finite) per item, from one VerifyBatch and one host copy.

    Uniforms and Exp(1) noise come from each request's own generator (greedy rows need neither: their p is
    one-hot), so a row's draws do not depend on the other rows. (A seeded sampling request still speculates only
    when it asks to: whether speculation runs for it depends on the batch, see SamplingParams.speculate.)
    """
    dev, vocab = logits.device, logits.shape[-1]
    ns = [len(it.draft.tokens) for it in items]
    b, k = len(items), max(ns)
    idx = torch.tensor([it.row + j for it, n in zip(items, ns, strict=True) for j in range(n + 1)], device=dev)
    rows = logits.index_select(0, idx)
    bad = nonfinite_rows(rows)
    rows = rows.masked_fill(bad[:, None], 0.0)
    p = processed_probs(rows, [it.seq.request.params for it, n in zip(items, ns, strict=True) for _ in range(n + 1)])
    target = p.new_full((b, k + 1, vocab), 1.0 / vocab)
    tokens = torch.zeros(b, k, dtype=torch.int64)
    with_q = any(it.draft.probs is not None for it in items)
    q = p.new_full((b, k, vocab), 1.0 / vocab) if with_q else None
    uniforms = torch.full((b, k), 0.5, device=dev)
    noise = torch.ones(b, vocab, device=dev)
    at = 0
    for i, (it, n) in enumerate(zip(items, ns, strict=True)):
        target[i, : n + 1] = p[at : at + n + 1]
        at += n + 1
        tokens[i, :n] = torch.tensor(it.draft.tokens, dtype=torch.int64)
        if q is not None and n:
            q[i, :n] = it.draft.probs if it.draft.probs is not None else _one_hot(it.draft.tokens, vocab, dev)
        req = it.seq.request
        if not req.params.greedy:
            uniforms[i, :n] = torch.rand(n, generator=req.generator, device=dev)
            noise[i] = torch.empty(vocab, device=dev).exponential_(generator=req.generator).clamp_(min=1e-30)
    owner = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(ns, device=dev) + 1)
    finite = torch.zeros(b, device=dev).index_add_(0, owner, bad.float()) == 0  # no bad row among the item's n + 1
    batch = VerifyBatch(target, tokens.to(dev), q, torch.tensor(ns, dtype=torch.int32, device=dev), uniforms, noise)
    accepted, nxt = verifier(batch)
    host = torch.stack([accepted.long(), nxt.long(), finite.long()]).tolist()  # the one device -> host copy
    return [(a, t, bool(f)) for a, t, f in zip(*host, strict=True)]


def _one_hot(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab, device=device)
    return out.scatter_(-1, torch.tensor(tokens, device=device)[:, None], 1.0)
