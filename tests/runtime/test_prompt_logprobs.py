"""SamplingParams.prompt_logprobs on the engine's paths, against the fake step model (tests/support/fake_step.py),
whose logits at a position are a fixed function of the tokens up to it: every prompt position's entry must equal
log_softmax of those logits exactly (the prompt token's value and rank, the top k in rank order), once per position,
however the prompt is cut into chunks, preempted, shared through the prefix cache or run beside async scheduling
and speculative decoding. The fake model also checks every cache slot a returned row reads. tests/runtime/
test_prompt_logprobs_hf.py checks the values of a real model against transformers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kiln.runtime import prompt_logprobs as prompt_module
from kiln.runtime.batch_sampler import NONFINITE_LOGITS
from kiln.runtime.engine import Engine
from kiln.runtime.logprob import Logprob
from kiln.runtime.sampling_params import SamplingParams
from tests.support.engine_machines import speculative_engine
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate, fake_logits

V = 97


def expected(prompt: list[int], k: int) -> list:
    """The prompt logprobs the engine must give: from the logits at each position before a prompt token, the top k
    with ranks 1 .. k, then the prompt token with its own rank (vLLM's: the tokens at least as likely)."""
    lps = [None]
    for i in range(1, len(prompt)):
        lp = fake_logits(prompt[:i], V).log_softmax(-1)
        top = lp.topk(k)
        d = {int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(top.indices, top.values, strict=True))}
        d.setdefault(prompt[i], Logprob(float(lp[prompt[i]]), int((lp >= lp[prompt[i]]).sum())))
        lps.append(d)
    return lps


def engine(**kw) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return Engine(FakeStepModel(V), None, fake_config(64, vocab=V), **kw)


def run(eng: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list:
    """The final output of each job, in order, with every output checked to carry prompt logprobs as its kind says
    (a "delta" request's final output is given its whole token ids and the prompt logprobs of its first output)."""
    rids = [eng.add_request(prompt_token_ids=p, params=sp) for p, sp in jobs]
    final, seen = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            seen.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
    for rid, (_, sp) in zip(rids, jobs, strict=True):
        outs = seen[rid]
        carried = [o.prompt_logprobs is not None for o in outs]
        if sp.prompt_logprobs is None:
            assert not any(carried)
        elif sp.output_kind == "delta":
            assert carried == [True] + [False] * (len(carried) - 1)
        else:
            assert all(carried) and all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)
        if sp.output_kind == "delta":
            ids = [t for o in outs for t in o.outputs[0].token_ids]
            comp = dataclasses.replace(final[rid].outputs[0], token_ids=ids)
            final[rid] = dataclasses.replace(final[rid], outputs=[comp], prompt_logprobs=outs[0].prompt_logprobs)
    return [final[r] for r in rids]


def check(out, prompt: list[int], sp: SamplingParams) -> None:
    assert out.prompt_logprobs == expected(prompt, sp.prompt_logprobs)
    assert out.outputs[0].token_ids == fake_generate(prompt, sp.max_tokens, V)


def prompts(seed: int, n: int, lo: int = 1, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize(("budget", "pad"), [(1, False), (3, False), (7, True), (64, False), (64, True)])
def test_every_position_is_scored_once_whatever_the_chunks(budget, pad):
    """A budget of 1 makes every prompt chunk one unsampled token; 64 takes every prompt in one chunk. pad: decode
    steps are padded as for CUDA graphs (prompt rows never are: such a step has prompt chunks)."""
    ps = prompts(1, 6)
    jobs = [(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=i % 4,
                               output_kind=("cumulative", "delta", "final_only")[i % 3])) for i, p in enumerate(ps)]
    jobs.append((ps[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))  # not asked: untouched
    eng = engine(max_num_batched_tokens=budget, pad_decode_batches=pad)
    outs = run(eng, jobs)
    assert eng.runner.graph_stats.padded_decodes > 0 if pad else not eng.runner.graph_stats.padded_decodes
    for out, (p, sp) in zip(outs, jobs, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check(out, p, sp)
    assert outs[-1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_entries_hold_the_prompt_token_then_the_top_k_in_rank_order():
    p = prompts(2, 1, 20, 20)[0]
    for k in (0, 1, 5, 20):
        out = run(engine(), [(p, SamplingParams(max_tokens=1, prompt_logprobs=k))])[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for tok, d in zip(p[1:], out.prompt_logprobs[1:], strict=True):
            rank = d[tok].rank
            assert next(iter(d)) == tok  # vLLM v1's order: the prompt token first (where it is in the top k too)
            top = [lp for t, lp in d.items() if t != tok or rank <= k]
            vals = [lp.logprob for lp in sorted(top, key=lambda lp: lp.rank)]
            assert len(d) == k + (rank > k) and sorted(lp.rank for lp in top) == list(range(1, k + 1))
            assert vals == sorted(vals, reverse=True) and all(lp.logprob <= 0 for lp in d.values())
            if rank > k:  # outside the top k: after it in the dict's order, only the top k, by rank
                assert [lp.rank for lp in list(d.values())[1:]] == list(range(1, k + 1))
    one = run(engine(), [([5], SamplingParams(max_tokens=2, prompt_logprobs=3))])[0]
    assert one.prompt_logprobs == [None]


def test_prefix_cache_hits_never_skip_a_position_to_score():
    """Requests sharing a prefix: one with prompt logprobs reads nothing cached before its positions are scored (so
    its values are those of the first), a request without them still hits the cache."""
    rng = random.Random(3)
    shared = [rng.randrange(V) for _ in range(14)]
    a, b = shared + [1, 2, 3], shared + [4, 5]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    eng = engine(max_num_batched_tokens=5)
    first = run(eng, [(a, sp)])[0]
    again, other = run(eng, [(a, sp), (b, sp)])
    plain = run(eng, [(b, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))])[0]
    assert again.prompt_logprobs == first.prompt_logprobs
    check(first, a, sp)
    check(other, b, sp)
    assert again.metrics.num_cached_tokens == other.metrics.num_cached_tokens == 0
    assert plain.metrics.num_cached_tokens == 12 and plain.outputs[0].token_ids == other.outputs[0].token_ids


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_neither_duplicates_nor_loses_entries(caching):
    """A pool of 20 blocks of 4 for 8 prompts of 12..30 tokens in chunks of 8: requests are preempted mid-prefill and
    mid-decode, and recomputed (through the prefix cache where it may: the positions already scored)."""
    ps = prompts(4, 8, 12, 30)
    jobs = [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)) for p in ps]
    eng = engine(num_blocks=21, max_num_batched_tokens=8, enable_prefix_caching=caching)
    outs = run(eng, jobs)
    for out, (p, sp) in zip(outs, jobs, strict=True):
        check(out, p, sp)
    assert eng.scheduler.num_preemptions >= 4 and sum(o.metrics.num_preemptions > 0 for o in outs) >= 2
    if caching:  # prompt logprobs complete before the first token: a recompute after it may hit the cache
        # (the pool's hits: num_cached_tokens is vLLM's, the first admission's only, and nothing was cached then)
        assert eng.stats.prefix_cache_hits > 0 and not any(o.num_cached_tokens for o in outs)


def test_a_caller_editing_the_shared_list_cannot_reopen_scoring():
    """Outputs share the request's prompt_logprobs list (no copy per step): a caller who drops its leading None
    mid-run must not make a recompute after preemption score the prompt again."""
    p = prompts(6, 1, 20, 20)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    eng = engine()
    rid = eng.add_request(prompt_token_ids=p, params=sp)
    first = None
    while first is None:
        first = next((o for o in eng.step() if o.request_id == rid), None)
    first.prompt_logprobs.pop(0)  # the caller's own edit of what it was handed
    req = eng.requests[rid]
    eng.scheduler.preempt(req)  # recomputed from scratch: nothing may be scored again
    scored = []
    real = prompt_module.prompt_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kiln.runtime.engine.prompt_rows", lambda seqs: (scored.append(r := real(seqs)), r)[1])
        while eng.has_unfinished():
            eng.step()
    assert req.num_prompt_scored == len(p) and scored and all(r is None for r in scored)


def test_async_scheduling_takes_prompt_rows_in_with_their_step():
    """With async scheduling a step scoring prompts is never left in flight and no prompt to score is admitted ahead
    of one (neither first in the queue nor behind another), yet it is admitted as soon as without async scheduling,
    give or take a step; decode steps still run ahead; outputs equal those without it."""
    ps = prompts(5, 8, 3, 20)
    jobs = [(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=(i % 3) or None))
            for i, p in enumerate(ps)]

    def late(eng: Engine) -> tuple[list, dict[str, int]]:
        """Pairs of arrivals (the second one scoring its prompt when the first does not) while others decode; the
        final outputs and the step() call that made each request's first output."""
        rids, final, first, calls = [], {}, {}, 0

        def step() -> None:
            nonlocal calls
            calls += 1
            for out in eng.step():
                final[out.request_id] = out
                first.setdefault(out.request_id, calls)

        for i in range(0, len(jobs), 2):
            for p, sp in jobs[i : i + 2]:
                rids.append(eng.add_request(prompt_token_ids=p, params=sp))
            for _ in range(3):
                step()
        while eng.has_unfinished():
            step()
        return [final[r] for r in rids], [first[r] for r in rids]

    ahead = engine(overlap_outputs=True, async_scheduling=True)
    (got, got_first), (want, want_first) = late(ahead), late(engine(overlap_outputs=True))
    for g, w, (p, sp) in zip(got, want, jobs, strict=True):
        assert (g.prompt_logprobs, g.outputs[0].token_ids) == (w.prompt_logprobs, w.outputs[0].token_ids)
        if sp.prompt_logprobs is not None:
            check(g, p, sp)
    assert all(abs(a - b) <= 1 for a, b in zip(got_first, want_first, strict=True)), (got_first, want_first)
    assert ahead.stats.num_steps_ahead > 0


@pytest.mark.parametrize("kind", ["ngram", "own", "shared"])
def test_speculative_decoding_leaves_prompt_scoring_alone(kind):
    """Drafters (n-gram, a draft model with its own pool or the target's) and verification batches beside prompt
    chunks with rows to score, in a pool of 17 blocks of 4."""
    eng = speculative_engine(kind)
    rep = [3, 4, 5, 6] * 5  # repeats: the n-gram drafter proposes
    jobs = [(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1))
            for p in (rep, prompts(6, 1, 15, 15)[0] + rep[:6], prompts(9, 1, 9, 9)[0])]
    for out, (p, sp) in zip(run(eng, jobs), jobs, strict=True):
        check(out, p, sp)
    assert eng.spec_counters.proposed > 0


def test_rows_are_taken_to_fp32_a_block_at_a_time(monkeypatch):
    """Blocks of 2 rows (of a 97-token vocabulary) give exactly the values of one block."""
    ps = prompts(7, 3, 10, 20)
    jobs = [(p, SamplingParams(max_tokens=1, prompt_logprobs=4)) for p in ps]
    whole = run(engine(), jobs)
    calls = []
    real = torch.Tensor.log_softmax
    monkeypatch.setattr(prompt_module, "BLOCK_ELEMENTS", 2 * V + 1)
    monkeypatch.setattr(torch.Tensor, "log_softmax", lambda self, *a, **k: calls.append(self.shape[0]) or
                        real(self, *a, **k))
    blocked = run(engine(), jobs)
    assert [o.prompt_logprobs for o in blocked] == [o.prompt_logprobs for o in whole]
    assert calls and max(calls) == 2


class NaNAfter(FakeStepModel):
    """NaN logits wherever the context ends with `bad` (a prompt position of one request only)."""

    def __init__(self, bad: list[int]):
        super().__init__(V)
        self.bad = bad

    def logits(self, tokens: list[int]) -> torch.Tensor:
        row = super().logits(tokens)
        return torch.full_like(row, float("nan")) if tokens[-len(self.bad):] == self.bad else row


def test_non_finite_logits_at_a_prompt_position_fail_that_request_alone():
    good, bad = prompts(8, 2, 12, 12)
    eng = Engine(NaNAfter(bad[:5]), None, fake_config(64, vocab=V), block_size=4, num_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    ok, failed = run(eng, [(good, sp), (bad, sp)])
    check(ok, good, sp)
    assert failed.outputs[0].finish_reason == "error" and NONFINITE_LOGITS in failed.error
    assert failed.outputs[0].token_ids == [] and not eng.block_manager.tables


class TiedLogits(FakeStepModel):
    """The fake model's logits floored to steps of 8 ids: apart from the next token, every token ties with 7 others."""

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return torch.floor(fake_logits(tokens, self.vocab) / 2)


def test_a_prompt_tokens_rank_counts_the_tokens_tied_with_it():
    """vLLM's rank on exact ties: the number of tokens at least as likely, so a tied token ranks below all of them."""
    p = prompts(3, 1, 20, 20)[0]
    eng = Engine(TiedLogits(V), None, fake_config(64, vocab=V), block_size=4, num_blocks=64)
    out = run(eng, [(p, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))])[0]
    ties = 0
    for i in range(1, len(p)):
        lp = TiedLogits(V).logits(p[:i]).log_softmax(-1)
        rank = int((lp >= lp[p[i]]).sum())
        ties += rank != int((lp > lp[p[i]]).sum()) + 1
        assert out.prompt_logprobs[i] == {p[i]: Logprob(float(lp[p[i]]), rank)}
    assert ties > 0  # the prompt does land on tied tokens
