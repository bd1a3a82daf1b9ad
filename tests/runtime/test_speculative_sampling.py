"""Speculative sampling is exact: over many seeded requests on a 12-token vocabulary, with a draft model whose
distribution differs from the target's, the joint distribution of the first three generated tokens (the first
sampled as usual, the second and third through draft + verification) matches the target's computed directly
from the reference model, for temperature 1, top-k and top-p. A verifier with a wrong acceptance rule fails
the same test, so it has teeth.

False alarms: each exact case asserts p > 1e-3 (3 cases: at most 0.3% if the seeds were redrawn; the seeds are
fixed, so the outcome is deterministic)."""

from __future__ import annotations

import pytest
import torch

from kiln.reference import forward_logits
from kiln.runtime.engine import Engine
from kiln.runtime.sampler import processed_probs
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import ModelDrafter
from kiln.step import VerifyBatch
from tests.support.speculative import other_draft, spec_models
from tests.support.stats import chi_square_pvalue

V = 12
PROMPT = [3, 1, 4, 1, 5]
N = 1000  # requests per case
ALPHA = 1e-3


@pytest.fixture(scope="module")
def sm():
    return spec_models(vocab=V)


@pytest.fixture(scope="module")
def draft(sm):
    return other_draft(sm, seed=11, layers=1)


def target_joint(sm, params: SamplingParams) -> torch.Tensor:
    """[V, V, V]: P(t1, t2, t3 | PROMPT) under the target's processed distribution, from the uncached graph."""

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        logits = forward_logits(sm.reference, torch.tensor(seqs))[:, -1]
        return processed_probs(logits, [params] * len(seqs)).double()

    p1 = probs([PROMPT])[0]
    p2 = probs([[*PROMPT, a] for a in range(V)])
    p3 = probs([[*PROMPT, a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_joint(sm, draft, params: SamplingParams, verifier=None) -> tuple[torch.Tensor, dict]:
    """Counts [V, V, V] of (t1, t2, t3) over N seeded requests with k = 2 drafts per step."""
    target = sm.target
    if verifier is not None:
        target = type(target)(**{f: getattr(target, f) for f in target.__dataclass_fields__})
        target.verify = verifier
    eng = Engine(target, None, sm.loaded.model, drafter=ModelDrafter(draft, k=2), max_num_seqs=400,
                 speculation_max_batch=400)
    for seed in range(N):
        # speculate=True: seeded sampling does not speculate by default (SamplingParams.speculate)
        eng.add_request(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=4, seed=seed, ignore_eos=True,
                                                                       temperature=params.temperature,
                                                                       top_k=params.top_k, top_p=params.top_p,
                                                                       speculate=True))
    counts = torch.zeros(V, V, V, dtype=torch.long)
    for out in eng.run():
        a, b, c = out.outputs[0].token_ids[:3]
        counts[a, b, c] += 1
    return counts, eng.stats_dict()


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=4),
         SamplingParams(temperature=0.8, top_p=0.7)]


@pytest.mark.parametrize("params", CASES, ids=["t1", "top_k4", "top_p0.7"])
def test_speculative_tokens_follow_the_target_distribution(sm, draft, params):
    want = target_joint(sm, params)
    counts, stats = sampled_joint(sm, draft, params)
    assert stats["spec_rows"] >= N and 0 < stats["spec_accepted"] < stats["spec_proposed"]
    p = chi_square_pvalue(counts.flatten(), want.flatten())
    assert p > ALPHA, f"p = {p:.2e}: speculative samples do not follow the target ({stats})"


def resamples_from_p(b: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrong rule: after a rejection, draw from p instead of the residual max(0, p - q). (Ignoring q, i.e.
    accepting with p(d) and redrawing from p without d, would not do: that is a valid, slower rejection sampler.)"""
    a, nxt = torch.ops.kiln.spec_verify(b.target_probs, b.draft_tokens, b.draft_probs, b.num_drafts, b.uniforms,
                                        b.noise)
    rows = torch.arange(a.shape[0])
    from_p = (b.target_probs[rows, a.long()] / b.noise).argmax(-1)
    return a, torch.where(a < b.num_drafts, from_p, nxt)


def test_a_wrong_acceptance_rule_is_caught(sm, draft):
    params = CASES[0]
    counts, _ = sampled_joint(sm, draft, params, verifier=resamples_from_p)
    assert chi_square_pvalue(counts.flatten(), target_joint(sm, params).flatten()) < ALPHA
