"""launch_batch takes the finite flags and the greedy tokens from one max reduction; they must be those of the
definition: a row is unusable when it holds a NaN, a +inf or nothing but -inf (-inf alone is a masked token), and
a usable greedy row's token is its first argmax. Random rows with those values mixed in, greedy batches (the fast
return) and batches with sampled and logprob rows (the general one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime.batch_sampler import NONFINITE_LOGITS, nonfinite_rows, sample_batch
from kiln.runtime.sampler import make_generator, sample_rows
from kiln.runtime.sampling_params import SamplingParams

INF, NAN = float("inf"), float("nan")
values = st.one_of(st.sampled_from([NAN, INF, -INF, -INF, 0.0, 1.0, 1.0]), st.floats(-30, 30, allow_nan=False))


def reference_unusable(rows: torch.Tensor) -> torch.Tensor:
    return rows.isnan().any(dim=-1) | rows.isposinf().any(dim=-1) | rows.isneginf().all(dim=-1)


@st.composite
def logit_rows(draw) -> torch.Tensor:
    r, v = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    return torch.tensor(draw(st.lists(st.lists(values, min_size=v, max_size=v), min_size=r, max_size=r)))


@settings(max_examples=300, deadline=None)
@given(rows=logit_rows())
def test_finite_flags_and_greedy_tokens_follow_the_definition(rows):
    bad = reference_unusable(rows)
    assert nonfinite_rows(rows).tolist() == bad.tolist()
    params = [SamplingParams(temperature=0, max_tokens=4)] * rows.shape[0]
    got = sample_batch(rows, params, [None] * rows.shape[0], [()] * rows.shape[0])
    for i, row in enumerate(rows):
        if bad[i]:
            assert got.errors[i] == NONFINITE_LOGITS and got.tokens[i] == 0
        else:
            assert got.errors[i] is None and got.tokens[i] == int(row.argmax())
            assert row[got.tokens[i]] == row.max() and not (row[: got.tokens[i]] == row.max()).any()  # the first


@settings(max_examples=150, deadline=None)
@given(rows=logit_rows(), kinds=st.lists(st.sampled_from(["greedy", "sampled", "logprobs"]), min_size=6, max_size=6))
def test_mixed_batches_give_each_row_what_it_alone_would_get(rows, kinds):
    n = rows.shape[0]
    params = [SamplingParams(temperature=0, max_tokens=4) if k == "greedy" else
              SamplingParams(temperature=0.9, seed=i, max_tokens=4) if k == "sampled" else
              SamplingParams(temperature=0, max_tokens=4, logprobs=2) for i, k in enumerate(kinds[:n])]
    gens = [make_generator(p.seed, rows.device) for p in params]
    got = sample_batch(rows, params, gens, [()] * n)
    bad = reference_unusable(rows)
    for i, (row, p) in enumerate(zip(rows, params, strict=True)):
        if bad[i]:
            assert got.errors[i] == NONFINITE_LOGITS
            continue
        assert got.errors[i] is None
        if p.greedy:
            assert got.tokens[i] == int(row.argmax())
        else:  # the same draw as the row alone with a fresh generator of the same seed
            want = sample_rows(row[None], p, make_generator(p.seed, rows.device), [()])
            assert got.tokens[i] == int(want[0])
        if p.logprobs is not None:
            assert got.tokens[i] in got.logprobs[i]


@pytest.mark.gpu
def test_the_host_copy_is_queued_at_launch_and_waits_for_nothing_after_it():
    """On CUDA the sampled ids' host copy is queued when the batch is launched: result() must return while work
    launched after it (the next step, under async scheduling) still runs."""
    from kiln.runtime.batch_sampler import launch_batch

    logits = torch.randn(8, 50, device="cuda")
    params = [SamplingParams(temperature=0, max_tokens=4, logprobs=1 if i == 3 else None) for i in range(8)]
    launched = launch_batch(logits, params, [None] * 8, [()] * 8)
    torch.cuda._sleep(2_000_000_000)  # about a second of device time queued behind the copy
    got = launched.result()
    assert not torch.cuda.current_stream().query(), "result() waited for work launched after the batch"
    assert got.tokens == logits.argmax(-1).tolist() and got.tokens[3] in got.logprobs[3]
    torch.cuda.synchronize()
