"""SamplingParams validation and the sampler."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime.batch_sampler import NONFINITE_LOGITS, sample_batch
from kiln.runtime.sampler import apply_repetition_penalty, make_generator, process_logits, sample
from kiln.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.5, "temperature >= 0"),
        ("temperature", float("nan"), "temperature >= 0"),
        ("top_k", -2, "top_k >= -1"),
        ("top_k", 2.5, "top_k >= -1"),
        ("top_p", 0.0, "0 < top_p <= 1"),
        ("top_p", 1.5, "0 < top_p <= 1"),
        ("min_p", 1.1, "0 <= min_p <= 1"),
        ("min_p", -0.1, "0 <= min_p <= 1"),
        ("repetition_penalty", 0.0, "repetition_penalty > 0"),
        ("max_tokens", 0, "max_tokens >= 1"),
        ("seed", "abc", "0 .. 2**64 - 1, or None"),
        ("seed", 10**30, "0 .. 2**64 - 1, or None"),
        ("seed", -1, "0 .. 2**64 - 1, or None"),
        ("stop_token_ids", (3, -1), "token ids >= 0"),
    ],
)
def test_validation_names_parameter_value_and_range(field, value, allowed):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate()
    msg = str(err.value)
    assert f"{field} = {value!r}" in msg and allowed in msg


def test_defaults_and_edges_are_valid():
    for p in (SamplingParams(), SamplingParams(temperature=0, top_p=1.0, min_p=0.0, top_k=0, max_tokens=1, seed=0)):
        assert p.validate() is p


def _logits(seed: int = 0, n: int | None = None, vocab: int = 50) -> torch.Tensor:
    shape = (vocab,) if n is None else (n, vocab)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    logits = _logits(n=4)
    assert sample(logits[0], SamplingParams(temperature=0)) == int(logits[0].argmax())
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=0.999),
        SamplingParams(temperature=1e-4),
    ],
)
def test_degenerate_filters_equal_greedy(params):
    logits = _logits(1, n=16)
    for seed in range(3):
        assert torch.equal(sample(logits, params, make_generator(seed)), logits.argmax(-1))


def test_seed_reproducible_and_seeds_differ():
    logits = _logits(2, n=64, vocab=100)
    p = SamplingParams(temperature=1.5)
    a, b = sample(logits, p, make_generator(7)), sample(logits, p, make_generator(7))
    assert torch.equal(a, b)
    assert not torch.equal(a, sample(logits, p, make_generator(8)))


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = process_logits(logits[None], SamplingParams(top_p=0.8))[0]
    assert torch.isfinite(kept).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = process_logits(logits[None], SamplingParams(top_p=0.81))[0]
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    kept = process_logits(logits[None], SamplingParams(top_k=3))[0]
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    kept = process_logits(logits[None], SamplingParams(min_p=0.2))[0]  # threshold 0.1
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    gen = make_generator(0)
    draws = {sample(logits, SamplingParams(top_k=2), gen) for _ in range(200)}
    assert draws == {0, 1}


def test_top_k_keeps_every_token_tied_with_the_kth_as_hf_does():
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [0.0, 5.0, 1.0, 1.0, 1.0, 5.0]])
    for k in (1, 2, 3, 4):
        hf = TopKLogitsWarper(top_k=k)(None, logits.clone()).softmax(-1)
        ours = process_logits(logits, SamplingParams(top_k=k)).softmax(-1)
        torch.testing.assert_close(ours, hf)
    assert torch.isfinite(process_logits(logits, SamplingParams(top_k=2))).sum(-1).tolist() == [4, 2]


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_min_p_keeps_what_hf_keeps(min_p, temperature):
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(5)) * 2
    # temperature first, then min-p against the most likely token's probability (HF's and vLLM V1's alike here)
    scores = logits.clone() if temperature == 1.0 else TemperatureLogitsWarper(temperature)(None, logits.clone())
    hf = MinPLogitsWarper(min_p=min_p)(None, scores)
    ours = process_logits(logits, SamplingParams(min_p=min_p, temperature=temperature))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf))
    assert 0 < torch.isfinite(ours).sum() < ours.numel()  # every row keeps its top token; some rows drop some
    torch.testing.assert_close(ours.softmax(-1), hf.softmax(-1))


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 0.9])
def test_min_p_cuts_between_tokens_just_above_and_just_below_its_threshold(min_p):
    """p_i >= min_p * p_max is kept: one token at 1.001 times the threshold, one at 0.999 times it."""
    probs = torch.tensor([1.0, min_p * 1.001, min_p * 0.999, min_p * 0.5, min_p * 2 if min_p <= 0.5 else 0.95])
    for scale in (1.0, 0.25):  # the threshold follows p_max, whatever the total
        kept = process_logits(torch.log(probs * scale)[None], SamplingParams(min_p=min_p))[0]
        assert torch.isfinite(kept).tolist() == [True, True, False, False, True]


def _vllm_v1_process(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM V1's Sampler.sample on logits, as its source reads: temperature, then the argmax-invariant logits
    processors (min-p: keep p >= min_p * p_max), then top-k and top-p on the sorted logits (ascending: a token is
    dropped while the mass up to and including it is <= 1 - top_p; the most likely is always kept)."""
    x = logits / temperature
    if min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    x_sort, idx = x.sort(dim=-1, descending=False)
    if top_k > 0:
        x_sort = x_sort.masked_fill(x_sort < x_sort[:, -top_k:-top_k + 1 or None], float("-inf"))
    if top_p < 1:
        drop = x_sort.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        x_sort = x_sort.masked_fill(drop, float("-inf"))
    return x_sort.scatter(-1, idx, x_sort)


def test_min_p_comes_before_top_p_as_in_vllm():
    """min-p filters before top-p renormalizes: 0.5 / 0.3 / 0.1 / 0.1 with min_p 0.3 leaves 0.625 / 0.375, and
    top_p 0.6 then keeps the first token alone (top-p first would keep two: 0.5 is below 0.6)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    kept = process_logits(logits, SamplingParams(min_p=0.3, top_p=0.6))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]
    assert torch.isfinite(_vllm_v1_process(logits, 1.0, 0, 0.6, 0.3)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 0.9, 0.05), (0.6, 20, 0.95, 0.1), (1.3, 0, 0.5, 0.2), (0.8, 5, 0.7, 0.01), (1.0, 50, 1.0, 0.3),
    (0.7, 0, 0.8, 0.0)])
def test_temperature_top_k_top_p_min_p_together_match_vllm(temperature, top_k, top_p, min_p):
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(9)) * 3
    ours = process_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    want = _vllm_v1_process(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(want))
    torch.testing.assert_close(ours.softmax(-1), want.softmax(-1))


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    draws = sample(logits.expand(4000, 3), SamplingParams(), make_generator(0))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)
    hot = sample(logits.expand(4000, 3), SamplingParams(temperature=100.0), make_generator(0))
    assert torch.bincount(hot, minlength=3).min() > 1100  # high temperature flattens towards uniform


def test_repetition_penalty_hf_rule():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]  # positive divided, negative multiplied, unseen untouched
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # input not modified


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([3.0, 2.5, -1.0])
    assert sample(logits, SamplingParams(temperature=0), prev_tokens=[0]) == 0
    assert sample(logits, SamplingParams(temperature=0, repetition_penalty=1.5), prev_tokens=[0]) == 1
    rows = torch.stack([logits, logits])
    got = sample(rows, SamplingParams(temperature=0, repetition_penalty=1.5), prev_tokens=[[0], [1]])
    assert got.tolist() == [1, 0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-45),
        SamplingParams(temperature=1e-300, top_p=0.5, min_p=0.5),
        SamplingParams(temperature=1e-6, top_k=3),
        SamplingParams(temperature=2e-5),  # just above the floor: sampled, but the gaps make it argmax
    ],
)
def test_tiny_temperatures_are_greedy_without_overflow(params):
    logits = _logits(3, n=8) * 1e3  # big gaps: at 2e-5 the runner-up is exp(-gap / 2e-5) = 0 in fp32
    for seed in range(3):
        assert torch.equal(sample(logits, params, make_generator(seed)), logits.argmax(-1))


def test_extreme_penalties_and_temperatures_stay_finite():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [-5.0, -6.0, -7.0, -8.0]])
    rows = torch.stack([apply_repetition_penalty(r, torch.tensor([0, 1, 2, 3]), 1e-300) for r in logits])
    assert torch.isfinite(rows).all()
    rows = torch.stack([apply_repetition_penalty(r, torch.tensor([0, 1, 2, 3]), 1e300) for r in logits])
    assert torch.isfinite(rows).all()
    for p in (SamplingParams(repetition_penalty=1e-300), SamplingParams(repetition_penalty=1e300, temperature=1e300),
              SamplingParams(temperature=1e300, top_p=1e-300), SamplingParams(temperature=1e-300, min_p=0.999999)):
        got = sample(logits, p, make_generator(0), prev_tokens=[[0, 1, 2, 3], [0, 1, 2, 3]])
        assert ((0 <= got) & (got < 4)).all()
    # A tiny penalty makes a seen positive logit dominate; temperature 1e300 is uniform.
    assert sample(logits[0], SamplingParams(temperature=0, repetition_penalty=1e-300), prev_tokens=[2]) == 2
    flat = sample(logits[0].expand(4000, 4), SamplingParams(temperature=1e300), make_generator(0))
    assert torch.bincount(flat, minlength=4).min() > 850


def test_sample_batch_flags_non_finite_rows_and_isolates_failures():
    logits = _logits(4, n=5)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = float("-inf")  # some masked tokens are fine
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=1),
              SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0.5, seed=2)]
    gens = [make_generator(p.seed) for p in params]
    res = sample_batch(logits, params, gens, [(), (), (), [1], ()])
    assert res.errors[0] is None and res.errors[4] is None
    assert all(e == NONFINITE_LOGITS for e in res.errors[1:4])
    assert res.tokens[0] == int(logits[0].argmax()) and res.tokens[4] >= 10
    gens[4] = "broken"  # one row's sampler raising does not touch the others
    res = sample_batch(logits[[0, 4]], [params[0], params[4]], [None, "broken"], [(), ()])
    assert res.errors[0] is None and res.tokens[0] == int(logits[0].argmax())
    assert res.errors[1].startswith("sampling failed (TypeError")


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({"stop_token_ids": 5}, (5,)),
        ({"stop_token_ids": [5, 6]}, (5, 6)),
        ({"stop_token_ids": torch.tensor([7, 8])}, (7, 8)),
        ({"stop_token_ids": torch.tensor(9)}, (9,)),
        ({"stop_token_ids": None}, ()),
    ],
)
def test_stop_token_ids_accept_one_id_or_any_sequence(kwargs, want):
    p = SamplingParams(**kwargs).validate()
    assert p.stop_token_ids == want and all(type(t) is int for t in p.stop_token_ids)
    hash(p)  # still a hashable frozen dataclass


def test_coerce_dicts_and_name_unknown_fields():
    assert SamplingParams.coerce({"temperature": 0, "max_tokens": 3}) == SamplingParams(temperature=0, max_tokens=3)
    assert SamplingParams.coerce(None) == SamplingParams()
    with pytest.raises(RequestError, match="unknown field.*'top_kk'"):
        SamplingParams.coerce({"top_kk": 1})
    with pytest.raises(RequestError, match="not list"):
        SamplingParams.coerce([1])


def test_sample_batch_copies_to_the_host_once(monkeypatch):
    """The finite flags ride along with the tokens: one tolist() per batch, no item() / int() per row."""
    calls = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k: calls.append(_name) or _real(self, *a, **k))
    logits = _logits(5, n=4)
    logits[2, 1] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.5)]
    res = sample_batch(logits, params, [make_generator(p.seed) for p in params], [(), (), (), [1, 2]])
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert res.errors == [None, None, NONFINITE_LOGITS, None] and res.tokens[0] == int(logits[0].argmax())


def test_logprobs_of_the_greedy_token_and_the_top_k_match_log_softmax():
    logits = _logits(n=3, vocab=11)
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, logprobs=0, seed=3)]
    out = sample_batch(logits, params, [None, None, make_generator(3)], [(), (), ()])
    ref = logits.log_softmax(-1)
    assert out.tokens[:2] == logits[:2].argmax(-1).tolist() and out.logprobs[1] is None
    top = ref[0].topk(4)
    assert list(out.logprobs[0]) == top.indices.tolist()  # ranked, the greedy token first
    assert out.logprobs[0][out.tokens[0]].logprob == pytest.approx(float(ref[0].max()), abs=1e-6)
    assert [lp.logprob for lp in out.logprobs[0].values()] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert [lp.rank for lp in out.logprobs[0].values()] == [1, 2, 3, 4]
    # logprobs=0: only the sampled token, from the raw distribution (before temperature), as vLLM v1 reports
    assert list(out.logprobs[2]) == [out.tokens[2]]
    got = out.logprobs[2][out.tokens[2]]
    assert got.logprob == pytest.approx(float(ref[2, out.tokens[2]]), abs=1e-6)
    assert got.rank == int((ref[2] >= ref[2, out.tokens[2]]).sum())  # vLLM's: the tokens at least as likely


def test_logprobs_keep_the_sampled_token_when_it_is_outside_the_top_k():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.1]])
    params = SamplingParams(temperature=0, logprobs=1, repetition_penalty=1e3)
    out = sample_batch(logits, [params], [None], [(0, 1, 2)])  # the penalty makes token 3 the greedy pick
    assert out.tokens == [3] and list(out.logprobs[0]) == [3, 0]  # vLLM v1's order: the sampled token first
    assert out.logprobs[0][3].logprob == pytest.approx(float(logits.log_softmax(-1)[0, 3]), abs=1e-6)
    assert (out.logprobs[0][0].rank, out.logprobs[0][3].rank) == (1, 4)  # the least likely of 4 tokens


def test_the_sampled_tokens_rank_counts_the_tokens_tied_with_it():
    """vLLM's rank: the number of tokens at least as likely, so a token tied with others ranks below all of them."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0], [3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=0),  # greedy on a tie: token 0
              SamplingParams(temperature=0, logprobs=0, logit_bias={2: 100.0}),  # token 2, tied with 1 and 3
              SamplingParams(temperature=0.8, logprobs=0, seed=1)]  # any token of four equal ones
    out = sample_batch(logits, params, [None, None, make_generator(1)], [(), (), ()])
    assert out.tokens[:2] == [0, 2]
    ranks = [lp[t].rank for lp, t in zip(out.logprobs, out.tokens, strict=True)]
    assert ranks == [2, 4, 4]
    # the logprob is the raw distribution's, before logit_bias
    assert out.logprobs[1][2].logprob == pytest.approx(float(logits[1].log_softmax(-1)[2]), abs=1e-6)


def test_logprobs_do_not_change_the_tokens():
    logits = _logits(n=4, vocab=13)
    base = [SamplingParams(temperature=0.9, seed=i) for i in range(4)]
    plain = sample_batch(logits, base, [make_generator(i) for i in range(4)], [()] * 4)
    asked = [SamplingParams(temperature=0.9, seed=i, logprobs=2 if i % 2 else None) for i in range(4)]
    with_lp = sample_batch(logits, asked, [make_generator(i) for i in range(4)], [()] * 4)
    assert plain.tokens == with_lp.tokens and plain.logprobs == [None] * 4
    assert [lp is None for lp in with_lp.logprobs] == [True, False, True, False]


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_logprobs_out_of_range_are_refused_naming_the_field(value):
    with pytest.raises(RequestError, match=r"logprobs = .* 0 \.\. 20"):
        SamplingParams(logprobs=value).validate()


def test_logprobs_on_a_vocab_smaller_than_k_list_every_token():
    logits = _logits(n=2, vocab=5)
    out = sample_batch(logits, [SamplingParams(temperature=0, logprobs=20)] * 2, [None, None], [(), ()])
    ref = logits.log_softmax(-1)
    for row, lp in enumerate(out.logprobs):
        assert sorted(lp) == list(range(5)) and next(iter(lp)) == out.tokens[row]
        assert [lp[t].logprob for t in range(5)] == pytest.approx(ref[row].tolist(), abs=1e-6)
        assert [v.rank for v in lp.values()] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=3),
                                    SamplingParams(top_p=0.6, temperature=1.3), SamplingParams(min_p=0.2)])
def test_processed_probs_is_the_distribution_sample_rows_draws_from(params):
    from kiln.runtime.sampler import processed_probs, sample_rows

    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(4)) * 2
    probs = processed_probs(logits, [params] * 5)
    assert torch.allclose(probs.sum(-1), torch.ones(5)) and (probs >= 0).all()
    for seed in range(5):  # the same draws from the same generator: one distribution, bit for bit
        want = sample_rows(logits, params, make_generator(seed), None)
        got = torch.multinomial(probs, 1, generator=make_generator(seed)).squeeze(-1)
        assert torch.equal(got, want)


def test_processed_probs_mixes_greedy_and_sampled_rows():
    from kiln.runtime.sampler import processed_probs

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2, seed=1), SamplingParams(temperature=0),
              SamplingParams(top_k=2, seed=2)]
    probs = processed_probs(logits, params)
    assert torch.equal(probs[[0, 2]], torch.nn.functional.one_hot(logits[[0, 2]].argmax(-1), 9).float())
    assert ((probs[[1, 3]] > 0).sum(-1) == 2).all()
    assert torch.equal(probs[[1, 3]], process_logits(logits[[1, 3]], params[1]).softmax(-1))
