"""Speculative sampling is exact: kiln::spec_verify emits tokens distributed as the target's, whatever the drafter.

Over many seeded rows (one row = one independent draw) with p and q given on a small vocabulary (V = 6), the first
emitted token (the draft when accepted, else next_token) must follow p, and with K = 2 the pair of the first two
emitted tokens must follow p_0(x) p_1(y | x). Checked by Pearson's chi-square (tests.support.stats) at a false-alarm
rate of ALPHA = 1e-4 per test, for temperature 1, top-k and top-p (p and q processed alike by the runtime's
process_logits, so p has zeros the drafter may propose), for drafted and deterministic (one-hot q) drafts.

Power: N = 40,000 draws over 6 cells (5 degrees of freedom) detect a chi-square distance sum((p' - p)^2 / p) of
1.5e-3 (0.01 of mass moved between two cells of probability 0.13) with probability > 0.99 (noncentrality 60 against
a critical value of 25.7; 500 of 500 simulated runs rejected it). The wrong acceptance rules below (always accept;
accept with min(1, q / p), the ratio upside down) and a wrong residual miss by far more, and the same test rejects
them. The reference op is vectorized over rows, so each test is one call; the interpreted kernel (about 20 ms a
row) gets a smaller run of N_KERNEL draws.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify)
from kiln.codegen.spec_verify import spec_verify as kernel
from kiln.runtime.sampler import process_logits
from kiln.runtime.sampling_params import SamplingParams
from tests.support.stats import chi_square_pvalue

reference = torch.ops.kiln.spec_verify.default
ALPHA = 1e-4
N = 40_000
N_KERNEL = 400
V = 6
TARGET_LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.6, 0.0, -0.7])
DRAFT_LOGITS = torch.tensor([-0.5, 0.2, 1.4, 0.9, 2.1, 0.3])  # a drafter that disagrees: its top tokens are p's last
PROCESSING = {
    "temperature": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9),
}
Verify = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return process_logits(logits.reshape(-1, V).float(), params).softmax(-1).reshape(logits.shape)


def _always_accept(tp, dt, dp, nd, u, noise):
    """Wrong: zero uniforms accept every draft the target does not rule out (p(d) > 0)."""
    return reference(tp, dt, dp, nd, torch.zeros_like(u), noise)


def _accept_q_over_p(tp, dt, dp, nd, u, noise):
    """Wrong: accept with min(1, q / p). u * p < q is u' * q < p for u' = u (p / q)^2, the op's own test."""
    if dp is None:  # the pair test's follow-up draw: no drafts to test
        return reference(tp, dt, dp, nd, u, noise)
    d = dt.clamp(0, V - 1)[..., None]
    ratio = tp[:, :-1].gather(-1, d).squeeze(-1) / dp.gather(-1, d).squeeze(-1)
    return reference(tp, dt, dp, nd, u * ratio * ratio, noise)


def _first_tokens(verify: Verify, p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor | None, n: int,
                  seed: int) -> torch.Tensor:
    """n draws with K = 1: the draft is drafts[row] (deterministic drafter) or drawn from q; emitted first token."""
    g = torch.Generator().manual_seed(seed)
    d = drafts if drafts is not None else torch.multinomial(q, n, replacement=True, generator=g)
    target = torch.stack([p, torch.full((V,), 1 / V)])[None].expand(n, 2, V).contiguous()
    draft_probs = q[None, None].expand(n, 1, V).contiguous() if q is not None and drafts is None else None
    num_drafts = torch.ones(n, dtype=torch.int32)
    uniforms = torch.rand(n, 1, generator=g)
    noise = torch.empty(n, V).exponential_(generator=g)
    acc, nxt = verify(target, d[:, None], draft_probs, num_drafts, uniforms, noise)
    return torch.where(acc >= 1, d, nxt)


def _pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    return chi_square_pvalue(torch.bincount(tokens, minlength=p.numel()), p.flatten())


@pytest.mark.parametrize("processing", list(PROCESSING))
def test_first_token_follows_the_target(processing):
    params = PROCESSING[processing]
    p, q = _probs(TARGET_LOGITS, params), _probs(DRAFT_LOGITS, params)
    assert (q - p).abs().sum() > 0.5  # the drafter is far off, so acceptance alone cannot give p
    first = _first_tokens(reference, p, q, None, N, seed=1)
    assert _pvalue(first, p) > ALPHA


@pytest.mark.parametrize("processing", list(PROCESSING))
def test_first_token_follows_the_target_with_deterministic_drafts(processing):
    """An n-gram drafter: q is one-hot on its proposal, whatever it is (here a fixed token, and one per row)."""
    p = _probs(TARGET_LOGITS, PROCESSING[processing])
    fixed = torch.full((N,), 2)
    assert _pvalue(_first_tokens(reference, p, None, fixed, N, seed=2), p) > ALPHA
    cycling = torch.arange(N) % V  # includes tokens p rules out
    assert _pvalue(_first_tokens(reference, p, None, cycling, N, seed=3), p) > ALPHA


def _pair_tables(params: SamplingParams, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    p0, q0 = _probs(TARGET_LOGITS, params), _probs(DRAFT_LOGITS, params)
    p1 = _probs(torch.randn(V, V, generator=g) * 1.5, params)  # p1[x] = p_1(. | x)
    q1 = _probs(torch.randn(V, V, generator=g) * 1.5, params)
    return p0, q0, p1, q1


def _first_pairs(verify: Verify, params: SamplingParams, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws with K = 2 drafts d1 ~ q0, d2 ~ q1[d1]; the pair (x, y) of the first two emitted tokens, as flat
    indices x * V + y, and its expected distribution p0(x) p1[x](y). When d1 is rejected, y comes from the
    target's next step (a verification with no drafts, i.e. a plain draw from p1[x])."""
    p0, q0, p1, q1 = _pair_tables(params, seed)
    g = torch.Generator().manual_seed(seed + 1)
    d1 = torch.multinomial(q0, n, replacement=True, generator=g)
    d2 = torch.multinomial(q1[d1], 1, generator=g)[:, 0]
    target = torch.stack([p0.expand(n, V), p1[d1], torch.full((n, V), 1 / V)], dim=1)
    acc, nxt = verify(target, torch.stack([d1, d2], -1), torch.stack([q0.expand(n, V), q1[d1]], dim=1),
                      torch.full((n,), 2, dtype=torch.int32), torch.rand(n, 2, generator=g),
                      torch.empty(n, V).exponential_(generator=g))  # fmt: skip
    x = torch.where(acc >= 1, d1, nxt)
    _, follow = verify(p1[x][:, None], torch.empty(n, 0, dtype=torch.long), None, torch.zeros(n, dtype=torch.int32),
                       torch.empty(n, 0), torch.empty(n, V).exponential_(generator=g))  # fmt: skip
    y = torch.where(acc == 2, d2, torch.where(acc == 1, nxt, follow))
    return x * V + y, (p0[:, None] * p1).flatten()


@pytest.mark.parametrize("processing", list(PROCESSING))
def test_two_token_continuation_follows_the_target(processing):
    pairs, expected = _first_pairs(reference, PROCESSING[processing], N, seed=10)
    assert _pvalue(pairs, expected) > ALPHA


@pytest.mark.parametrize("wrong", [_always_accept, _accept_q_over_p], ids=["always_accept", "accept_q_over_p"])
def test_the_test_rejects_wrong_acceptance_rules(wrong):
    """The same checks, same N and seeds, fail for a sampler whose acceptance rule is wrong."""
    p, q = _probs(TARGET_LOGITS, PROCESSING["temperature"]), _probs(DRAFT_LOGITS, PROCESSING["temperature"])
    assert _pvalue(_first_tokens(reference, p, q, None, N, seed=1), p) > ALPHA  # the right rule passes...
    assert _pvalue(_first_tokens(wrong, p, q, None, N, seed=1), p) < ALPHA  # ...and this one fails
    pairs, expected = _first_pairs(wrong, PROCESSING["temperature"], N, seed=10)
    assert _pvalue(pairs, expected) < ALPHA


def test_the_test_rejects_a_wrong_residual():
    """Drawing from p instead of max(0, p - q) at a rejection over-weights the drafter's favourites."""
    p, q = _probs(TARGET_LOGITS, PROCESSING["temperature"]), _probs(DRAFT_LOGITS, PROCESSING["temperature"])

    def from_p_on_rejection(tp, dt, dp, nd, u, noise):  # one-hot q at a token p gives all its mass: residual = p
        acc, _ = reference(tp, dt, dp, nd, u, noise)
        _, from_p = reference(tp[:, :1], dt[:, :0], None, torch.zeros_like(nd), u[:, :0], noise)
        return acc, from_p

    assert _pvalue(_first_tokens(from_p_on_rejection, p, q, None, N, seed=1), p) < ALPHA


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_interpreted_kernel_is_exact_too(with_q):
    """A smaller run on the generated kernel (top-k: p has zeros), checked against the reference's draws too."""
    params = PROCESSING["top_k"]
    p, q = _probs(TARGET_LOGITS, params), _probs(DRAFT_LOGITS, params)
    drafts = None if with_q else torch.arange(N_KERNEL) % V
    first = _first_tokens(kernel, p, q if with_q else None, drafts, N_KERNEL, seed=4)
    assert torch.equal(first, _first_tokens(reference, p, q if with_q else None, drafts, N_KERNEL, seed=4))
    assert _pvalue(first, p) > ALPHA


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_fake_propagation_gives_the_output_shapes(with_q):
    b, k = 4, 3
    with FakeTensorMode():
        acc, nxt = reference(torch.empty(b, k + 1, V), torch.empty(b, k, dtype=torch.long),
                             torch.empty(b, k, V) if with_q else None, torch.empty(b, dtype=torch.int32),
                             torch.empty(b, k), torch.empty(b, V))  # fmt: skip
    assert (acc.shape, acc.dtype, nxt.shape, nxt.dtype) == ((b,), torch.int32, (b,), torch.int64)


def test_greedy_rows_accept_the_matching_prefix():
    """One-hot p (greedy): drafts are accepted exactly while they match the target's argmax, whatever u is."""
    top = torch.tensor([[3, 1, 4, 0]])
    p = torch.nn.functional.one_hot(top, V).float()
    drafts = torch.tensor([[3, 1, 5]])  # the third disagrees
    for u in (torch.zeros(1, 3), torch.full((1, 3), 0.999)):
        acc, nxt = reference(p, drafts, None, torch.tensor([3], dtype=torch.int32), u, torch.rand(1, V) + 0.1)
        assert (acc.item(), nxt.item()) == (2, 4)
    acc, nxt = reference(p, top[:, :3], None, torch.tensor([3], dtype=torch.int32), torch.rand(1, 3),
                         torch.rand(1, V) + 0.1)  # fmt: skip
    assert (acc.item(), nxt.item()) == (3, 0)  # all three match: the bonus token is p_3's argmax
