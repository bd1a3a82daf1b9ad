"""Speculative decoding, greedy: the same token ids with and without speculation for the n-gram drafter, a self
drafter (layer 0 of the 2-layer tiny-llama, sharing its cache) and a separate draft model (other random weights,
own KV pool), over 48 mixed requests (repeated text, shared prefixes, stop tokens) on a pool small enough to
preempt; plus the per-request opt-out and the batch-size switch-off, counted. Reference ops, fp32."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import DEFAULT_SPECULATION_MAX_BATCH, ModelDrafter, NgramDrafter, ngram_lookup
from tests.support.speculative import other_draft, run_requests, self_draft, spec_models


@pytest.fixture(scope="module")
def sm():
    return spec_models()


@pytest.fixture(scope="module")
def trace():
    """48 (prompt, max_tokens): some prompts repeat a phrase (n-gram drafts get accepted), a third share a
    40-token prefix (prefix-cache hits), lengths 1..60."""
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(40)]
    out = []
    for i in range(48):
        phrase = [rng.randrange(512) for _ in range(rng.randint(1, 12))]
        prompt = phrase * rng.randint(1, 4) if i % 2 else phrase
        if i % 3 == 0:
            prompt = shared + prompt[:12]
        out.append((prompt[:60], rng.randint(1, 14)))
    return out


def greedy(n: int, stop: tuple[int, ...] = (), **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, stop_token_ids=stop, **kw)


def run(engine: Engine, trace, stops=None, **kw) -> list[list[int]]:
    stops = stops or {}

    def waste(e: Engine) -> None:
        assert all(0 <= w < e.block_manager.block_size for w in e.kv_waste())

    return run_requests(engine, [(p, greedy(n, stops.get(i, ()), **kw)) for i, (p, n) in enumerate(trace)], waste)


@pytest.fixture(scope="module")
def plain(sm, trace):
    """Outputs without speculation; every 5th request then gets its 3rd token as a stop token."""
    m = sm.loaded
    outs = run(Engine(sm.target, m.tokenizer, m.model, max_num_seqs=48), trace)
    stops = {i: (o[2],) for i, o in enumerate(outs) if i % 5 == 0 and len(o) > 3}
    want = [o[: o.index(stops[i][0]) + 1] if i in stops else o for i, o in enumerate(outs)]
    return stops, want


def drafter(sm, kind: str):
    if kind == "ngram":
        return NgramDrafter(n=3, k=4)
    if kind == "self":
        return ModelDrafter(self_draft(sm, 1), k=2, shares_target_cache=True)
    return ModelDrafter(other_draft(sm, seed=7, layers=1), k=2)


@pytest.mark.parametrize("kind", ["ngram", "self", "draft"])
def test_greedy_speculation_gives_the_same_tokens_under_preemption_and_prefix_caching(sm, trace, plain, kind):
    m = sm.loaded
    stops, want = plain
    # 17 usable blocks of 16 tokens (one 256-token context needs 16): 48 requests preempt each other.
    engine = Engine(sm.target, m.tokenizer, m.model, num_blocks=18, max_num_seqs=48, max_num_batched_tokens=256,
                    drafter=drafter(sm, kind), speculation_max_batch=48)
    assert run(engine, trace, stops) == want
    st = engine.stats
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert st.spec_accepted > 0 and st.spec_proposed > st.spec_accepted  # the path ran, both ways
    assert st.spec_emitted <= st.spec_rows + st.spec_accepted and st.spec_drafter_failures == 0  # stops drop tails
    assert 1.0 < st.mean_accepted_length <= 1 + (4 if kind == "ngram" else 2)


def test_opt_out_and_batch_switch_off_are_counted(sm, trace):
    m = sm.loaded
    eng = Engine(sm.target, m.tokenizer, m.model, max_num_seqs=48, drafter=NgramDrafter(), speculation_max_batch=48)
    run(eng, trace[:8], speculate=False)
    assert eng.stats.spec_proposed == 0 and eng.stats.spec_verify_steps == 0
    eng = Engine(sm.target, m.tokenizer, m.model, max_num_seqs=48, drafter=NgramDrafter(), speculation_max_batch=3)
    run(eng, trace[1::2][:8])  # 8 decodes at once: above 3, so speculation stays off until 3 or fewer remain
    st = eng.stats
    assert st.spec_off_steps > 0 and st.spec_verify_steps > 0
    eng = Engine(sm.target, m.tokenizer, m.model, drafter=NgramDrafter())
    assert eng.scheduler.spec_max_batch == DEFAULT_SPECULATION_MAX_BATCH  # the measured default
    eng = Engine(sm.target, m.tokenizer, m.model, max_num_seqs=48, drafter=NgramDrafter(), speculation_max_batch=0)
    run(eng, trace[:8])
    assert eng.stats.spec_proposed == 0 and eng.stats.spec_off_steps > 0


def test_repetition_penalty_and_logprobs_requests_do_not_speculate(sm, trace):
    m = sm.loaded
    for kw in ({"repetition_penalty": 1.2}, {"logprobs": 2}):
        eng = Engine(sm.target, m.tokenizer, m.model, drafter=NgramDrafter(), speculation_max_batch=48)
        run(eng, trace[1:9:2], **kw)
        assert eng.stats.spec_proposed == 0


def slow_ngram_lookup(tokens: list[int], n: int, k: int) -> list[int]:
    """The lookup written out in Python, position by position: what kiln's vectorized one must give."""
    total = len(tokens)
    for m in range(min(n, total - 1), 0, -1):
        for i in range(total - m - 1, -1, -1):  # latest start first, leaving a token after the match
            if tokens[i : i + m] == tokens[total - m :]:
                return tokens[i + m : i + m + k]
    return []


def test_ngram_lookup_takes_the_latest_earlier_match_longest_first():
    def look(tokens: list[int], n: int, k: int) -> list[int]:
        return ngram_lookup(np.array(tokens, dtype=np.int64), n, k)

    assert look([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3], 3, 4) == [8, 5, 2, 3]  # [2, 3] twice; latest wins
    assert look([1, 2, 3, 4, 1, 2, 3], 3, 2) == [4, 1]
    assert look([5, 6, 7], 3, 4) == []
    assert look([7, 7], 2, 4) == [7]
    assert look([4], 3, 4) == [] and look([], 3, 4) == []
    rng = random.Random(0)
    for _ in range(3000):  # small vocabularies: matches of every length, overlapping ones, none
        tokens = [rng.randrange(rng.choice((2, 3, 5, 40))) for _ in range(rng.randrange(0, 40))]
        n, k = rng.randrange(1, 5), rng.randrange(1, 6)
        assert look(tokens, n, k) == slow_ngram_lookup(tokens, n, k), (tokens, n, k)


def test_the_ngram_drafter_keeps_each_requests_tokens_as_they_grow():
    from kiln.runtime.detokenizer import Detokenizer
    from kiln.runtime.request import Request

    drafter = NgramDrafter(n=2, k=3)
    reqs = [Request(str(i), None, [1, 2, 3, i], SamplingParams(), Detokenizer(None)) for i in range(3)]
    rng = random.Random(1)
    for step in range(200):  # long enough to grow each buffer past its first size
        for req in reqs[: 1 + step % 3]:
            req.output_token_ids += [rng.randrange(4) for _ in range(rng.randrange(1, 3))]
            assert drafter.tokens_of(req).tolist() == req.all_token_ids
    assert len(drafter._tokens) == 3
    del reqs, req
    gc.collect()
    assert len(drafter._tokens) == 0  # dropped with their requests


def test_a_drafter_needs_a_verifier_and_a_matching_vocabulary(sm):
    m = sm.loaded
    bare = spec_models(layers=1)
    del bare.target.verify
    with pytest.raises(KilnError, match="no `verify`"):
        Engine(bare.target, m.tokenizer, m.model, drafter=NgramDrafter())
    small = other_draft(sm, seed=1, layers=1, vocab=256)
    with pytest.raises(KilnError, match="vocabulary"):
        Engine(sm.target, m.tokenizer, m.model, drafter=ModelDrafter(small))
    with pytest.raises(KilnError, match="self drafter"):
        Engine(sm.target, m.tokenizer, m.model, drafter=ModelDrafter(other_draft(sm, 1, layers=3),
                                                                       shares_target_cache=True))


def test_generated_kernels_verify_a_speculative_chunk(sm):
    """The one kernel-path check (Triton's interpreter on CPU): the paged prefill kernel over [last token, drafts]
    with every row sampled, drafts from a self drafter on a view of the kernel model's cache; the tokens equal
    the plain reference-op run."""
    from kiln.build import load_model
    from kiln.compile.step import compile_step
    from tests.support.speculative import reference_verify

    m = load_model("tiny-llama", device="cpu", seed=0)
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    step.verify = reference_verify
    prompt = [7, 8, 9, 10, 11] * 3
    want = run(Engine(sm.target, None, m.model, max_num_seqs=2), [(prompt, 6)])
    drafter = ModelDrafter(self_draft(sm, 1), k=2, shares_target_cache=True)
    eng = Engine(step, None, m.model, max_num_seqs=2, drafter=drafter, speculation_max_batch=2)
    assert run(eng, [(prompt, 6)]) == want
    assert eng.stats.spec_rows > 0


def test_a_draft_model_catches_up_long_prompts_within_the_token_budget(sm):
    """A draft model with its own pool computes a prompt it has not seen before drafting; with prompts longer than
    the engine's token budget that catch-up comes in chunks of at most the budget (those steps decode plainly),
    and the tokens are still exactly the plain ones."""
    m = sm.loaded
    rng = random.Random(5)
    phrase = [rng.randrange(512) for _ in range(9)]
    trace = [((phrase * 12)[: 70 + 9 * i], 12) for i in range(4)]
    want = run(Engine(sm.target, m.tokenizer, m.model, max_num_seqs=8), trace)
    budget = 24
    d = ModelDrafter(other_draft(sm, seed=7, layers=1), k=2)
    engine = Engine(sm.target, m.tokenizer, m.model, max_num_seqs=8, max_num_batched_tokens=budget, drafter=d,
                    speculation_max_batch=8)
    sizes = []
    execute = d.runner.execute

    def counted(sched):
        sizes.append(sched.num_tokens)
        return execute(sched)

    d.runner.execute = counted
    assert run(engine, trace) == want
    assert sizes and max(sizes) <= budget + 2 * len(trace)  # the catch-up budget, plus one sampled token per row
    assert any(n == budget for n in sizes)  # the budget was reached: the prompts did need chunks
    assert engine.stats.spec_proposed > 0 and engine.stats.spec_drafter_failures == 0  # drafting followed
