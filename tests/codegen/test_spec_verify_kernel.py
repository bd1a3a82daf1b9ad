"""The verification kernel (codegen/spec_verify.py, templates/spec_verify.py.j2) against kiln::spec_verify.

Token for token on the same uniforms and noise, at odd shapes (B 1/3/5, K 0/1/3, V 7/33/130, vocabulary tiles
smaller than V), with and without draft_probs. Rows cycle through kinds: greedy (one-hot p and q, a prefix match
then a mismatch), p == q with a draft where both are zero (the residual has no mass: the draw falls back to p),
truncated p (zeros, as after top-k / top-p), p == q accepting everything (a bonus token) and plain random rows;
num_drafts runs over 0..K; outputs are poisoned.
Interpreted without CUDA: about 20 ms a row, so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify)
from kiln.codegen._host import BoundKernels
from kiln.codegen.cache import cache_stats
from kiln.codegen.spec_verify import spec_verify
from kiln.compile.lowering import k_spec_verify
from kiln.compile.step import compile_step
from kiln.errors import KilnError
from kiln.ir.frontend import build_graph
from kiln.spec.loader import load_spec
from kiln.step import VerifyBatch

reference = torch.ops.kiln.spec_verify.default
POISON = -7


def _truncate(probs: torch.Tensor, keep: int) -> torch.Tensor:
    """Top-k truncation (renormalized), as the sampler's processing leaves p and q."""
    top = probs.topk(min(keep, probs.shape[-1]), dim=-1).indices
    kept = torch.zeros_like(probs).scatter_(-1, top, probs.gather(-1, top))
    return kept / kept.sum(-1, keepdim=True)


def _batch(b: int, k: int, v: int, with_q: bool, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    d = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, k) if k else torch.empty(b, 0, dtype=torch.long)
    n = torch.arange(b, dtype=torch.int32) % (k + 1)
    for row in range(b):
        kind = row % 5
        if kind == 0:  # greedy: one-hot p and q, drafts agree with the target's argmax up to a last mismatch
            top = p[row].argmax(-1)
            p[row] = torch.nn.functional.one_hot(top, v).float()
            d[row] = top[:k]
            if k:
                d[row, -1] = (top[k - 1] + 1) % v
            q[row] = torch.nn.functional.one_hot(d[row], v).float()
            n[row] = k
        elif kind in (1, 3):  # p == q: every draft with q(d) > 0 is accepted (kind 3: all of them, then a bonus)
            p[row] = _truncate(p[row], max(1, v // 2))
            q[row] = p[row, :k]
            d[row] = q[row].argmax(-1)
            zeros = (q[row, n[row] - 1] == 0).nonzero() if kind == 1 and n[row] > 0 else []
            if len(zeros):  # the last draft on a token both give 0: rejected, and no residual mass
                d[row, n[row] - 1] = zeros[0, 0]
        elif kind == 2:  # truncated target, full-support draft
            p[row] = _truncate(p[row], 3)
    d = torch.where(torch.arange(k)[None, :] < n[:, None].long(), d, -1)  # entries past num_drafts are junk
    u = torch.rand(b, k, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    return p, d, q if with_q else None, n, u, noise


def _check(args: tuple, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    b = args[0].shape[0]
    acc_out = torch.full((b,), POISON, dtype=torch.int32)
    tok_out = torch.full((b,), POISON, dtype=torch.int64)
    acc, tok = spec_verify(*args, block_v=block_v, num_accepted=acc_out, next_token=tok_out)
    assert acc is acc_out and tok is tok_out
    want_acc, want_tok = reference(*args)
    assert torch.equal(acc, want_acc), f"num_accepted {acc.tolist()} != reference {want_acc.tolist()}"
    assert torch.equal(tok, want_tok), f"next_token {tok.tolist()} != reference {want_tok.tolist()}"
    return acc, tok


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("v", [7, 33, 130])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_kernel_equals_reference_token_for_token(k, v, with_q):
    b = {0: 3, 1: 5, 3: 5}[k] if v != 130 else 1 + 2 * (k % 3)
    args = _batch(b, k, v, with_q, seed=100 * k + v)
    block_v = 16 if v > 16 else None  # several tiles: the running argmax crosses tile boundaries
    acc, tok = _check(args, block_v)
    assert ((0 <= tok) & (tok < v)).all()
    assert (acc <= args[3]).all()


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 6), k=st.integers(0, 4), v=st.integers(1, 70), with_q=st.booleans(),
       block_v=st.sampled_from([None, 1, 4, 16]), seed=st.integers(0, 2**16))  # fmt: skip
def test_kernel_equals_reference_on_any_shape(b, k, v, with_q, block_v, seed):
    _check(_batch(b, k, v, with_q, seed), block_v)


def test_the_batch_covers_its_cases():
    """The rows above do reach what they are built for: a greedy prefix match then the target's token, a rejection
    with no residual (the draw falls back to p), and a full acceptance with a bonus token."""
    p, d, q, n, u, noise = _batch(5, 3, 33, True, seed=333)
    acc, tok = _check((p, d, q, n, u, noise), block_v=16)
    assert acc[0] == 2 and tok[0] == p[0, 2].argmax()  # greedy: two matches, then the target's argmax
    assert n[1] == 1 and acc[1] == 0 and q[1, 0, d[1, 0]] == 0  # p == q, the draft rejected, no residual mass
    assert p[1, 0, tok[1]] > 0  # ...so the token came from p
    assert n[3] == 3 and acc[3] == 3 and p[3, 3, tok[3]] > 0  # all accepted, a bonus token from p_K


@pytest.mark.parametrize("block_v", [None, 8, 64])
def test_tile_size_does_not_change_the_draw(block_v):
    args = _batch(3, 1, 33, True, seed=5)
    _check(args, block_v)


def test_ties_go_to_the_first_index_like_argmax():
    # Equal keys everywhere (uniform p, equal noise): torch.argmax's first index, not a later tile's.
    v = 33
    p = torch.full((2, 2, v), 1 / v)
    p[1, 0, :4] = 0.0  # row 1 rejects its draft on a zero and draws from the residual p - one-hot(d)
    d = torch.tensor([[5], [2]])
    args = (p, d, None, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 1), torch.ones(2, v))
    _, tok = _check(args, block_v=8)
    assert tok.tolist() == [0, 4]


def test_index_dtypes_and_out_of_range_counts():
    p, d, q, n, u, noise = _batch(5, 3, 7, True, seed=11)
    n = torch.tensor([-2, 0, 3, 9, 1], dtype=torch.int64)  # outside 0..K counts as none / all K
    _check((p, d.to(torch.int32), q, n, u, noise))


def test_strided_inputs():
    p, d, q, n, u, noise = _batch(3, 3, 33, True, seed=12)
    wide = torch.zeros(3, 4, 40)
    wide[..., :33] = p
    _check((wide[..., :33], d.t().contiguous().t(), q, n, u.t().contiguous().t(), noise))


def test_empty_batch():
    acc, tok = spec_verify(torch.ones(0, 3, 5), torch.zeros(0, 2, dtype=torch.long), None,
                           torch.zeros(0, dtype=torch.int32), torch.zeros(0, 2), torch.ones(0, 5))  # fmt: skip
    assert acc.shape == tok.shape == (0,) and acc.dtype == torch.int32 and tok.dtype == torch.int64


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "target_probs": a["target_probs"].half()}, "target_probs has dtype"),
        (lambda a: {**a, "target_probs": a["target_probs"][0]}, "target_probs must have 3 dims"),
        (lambda a: {**a, "draft_tokens": a["draft_tokens"][:, :1]}, "draft_tokens has shape"),
        (lambda a: {**a, "draft_tokens": a["draft_tokens"].float()}, "draft_tokens has dtype"),
        (lambda a: {**a, "draft_probs": a["draft_probs"][..., :-1]}, "pass None for deterministic drafts"),
        (lambda a: {**a, "num_drafts": a["num_drafts"][:1]}, "num_drafts has shape"),
        (lambda a: {**a, "uniforms": a["uniforms"].double()}, "uniforms has dtype"),
        (lambda a: {**a, "noise": a["noise"][:, :-1]}, "noise has shape"),
        (lambda a: {**a, "block_v": 12}, "block_v=12 must be a power of two"),
        (lambda a: {**a, "next_token": torch.zeros(2, dtype=torch.int32)}, "next_token must be a torch.int64"),
    ],
)
def test_misuse_is_a_kiln_error_naming_the_input(change, message):
    p, d, q, n, u, noise = _batch(2, 2, 7, True, seed=3)
    names = ("target_probs", "draft_tokens", "draft_probs", "num_drafts", "uniforms", "noise")
    kwargs = change(dict(zip(names, (p, d, q, n, u, noise), strict=True)))
    with pytest.raises(KilnError, match=message):
        spec_verify(**kwargs)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_compiled_step_carries_its_verifier(use_kernels):
    cfg = load_spec("tiny-llama").model
    model = compile_step(build_graph(cfg, seed=0), cfg, use_kernels=use_kernels)
    if use_kernels:
        assert isinstance(model.verify.fn, BoundKernels) and model.verify.fn.fn is k_spec_verify
    else:
        assert model.verify.fn is reference
    for with_q in (True, False):
        args = _batch(3, 2, cfg.vocab, with_q, seed=21)
        renders = cache_stats().renders
        got = model.verify(VerifyBatch(*args))
        assert cache_stats().renders == renders, "the verifier's kernels are rendered at compile time"
        want = reference(*args)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
