"""vLLM's sampling parameters beyond HF's: presence / frequency penalties (output tokens only), min_tokens,
logit_bias and n, against direct computations of vLLM's rules; the engine paths (plain, async, speculative) on the
fake step model, whose logits are known in closed form."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.sampler import TokenHistory, apply_penalties, sample
from kiln.runtime.sampling_params import SEED_MAX, SamplingParams
from kiln.runtime.speculative import NgramDrafter
from kiln.tokenizer import ByteTokenizer
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate, fake_logits

V = 128
PROMPT = [72, 105, 33, 5, 9, 14, 72, 105]


def vllm_logits(logits: torch.Tensor, prompt: list[int], output: list[int], *, presence: float = 0.0,
                frequency: float = 0.0, repetition: float = 1.0, bias: dict[int, float] | None = None,
                min_tokens: int = 0, held: tuple[int, ...] = ()) -> torch.Tensor:
    """vLLM's sampler written out token by token (fp32, its order): min_tokens' mask and logit_bias, then the
    repetition penalty on prompt + output, then frequency * count and presence * (count > 0) over the output."""
    x = logits.float().clone()
    if len(output) < min_tokens:
        for t in held:
            x[t] = float("-inf")
    for t, b in (bias or {}).items():
        x[t] = x[t] + b
    if repetition != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in Counter(output).items():
        x[t] = x[t] - frequency * c
        x[t] = x[t] - presence * 1.0
    return x


def oracle(prompt: list[int], n: int, stops: tuple[int, ...] = (), model: FakeStepModel | None = None,
           **kw) -> list[int]:
    """Greedy generation on the fake model with vllm_logits: the tokens the engine must give."""
    model = model or FakeStepModel(V)
    out: list[int] = []
    for _ in range(n):
        tok = int(vllm_logits(model.logits(prompt + out), prompt, out, **kw).argmax())
        out.append(tok)
        if tok in stops:
            break
    return out


class RepeatModel(FakeStepModel):
    """Greedy repeats the last token unless a penalty holds it back: a penalty that misses the last token shows."""

    def logits(self, tokens: list[int]) -> torch.Tensor:
        x = fake_logits(tokens, self.vocab) - 1  # the fake model's peak at -1, the last token above it
        x[tokens[-1]] = -0.5
        return x


def engine(**kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(kw.pop("model", FakeStepModel(V)), kw.pop("tokenizer", ByteTokenizer(V)), fake_config(64, V), **kw)


def final(e: Engine, params: SamplingParams, prompt: list[int] = PROMPT):
    rid = e.add_request(prompt_token_ids=prompt, params=params)
    return {o.request_id: o for o in e.run()}[rid].outputs[0]


# ---- the rules, on logits -------------------------------------------------------------------------------------


def test_penalties_and_logit_bias_are_vllms_formula_counting_output_tokens_only():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 3
    prompt, output = [0, 1, 5], [1, 2, 2, 3, 2]
    kw = dict(presence=0.7, frequency=0.4, repetition=1.3, bias={2: 1.5, 7: -4.0, 0: 2.0})
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                       logit_bias={2: 1.5, 7: -4.0, 0: 2.0})
    got = apply_penalties(logits, p, TokenHistory(prompt, output))
    assert torch.allclose(got, vllm_logits(logits, prompt, output, **kw), rtol=0, atol=1e-6)
    # bias before the repetition penalty: token 0 (prompt only, positive once biased) is (x + b) / r, and gets no
    # presence / frequency penalty, which count the output alone
    assert got[0] == pytest.approx(float((logits[0] + 2.0) / 1.3 if logits[0] + 2.0 > 0 else (logits[0] + 2.0) * 1.3))
    only = apply_penalties(logits, SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), TokenHistory(prompt,
                                                                                                             output))
    assert torch.equal(only[[0, 5, 4]], logits[[0, 5, 4]])  # in the prompt only, or nowhere: untouched
    assert only[2] == pytest.approx(float(logits[2]) - 0.4 * 3 - 0.7) and only[3] == pytest.approx(
        float(logits[3]) - 0.4 - 0.7)
    neg = apply_penalties(logits, SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5),
                          TokenHistory((), output))  # negative values encourage repetition
    assert neg[2] == pytest.approx(float(logits[2]) + 1.5 + 1.0)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(10)
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    masked = apply_penalties(logits, p, TokenHistory([1], [5, 6], eos_token_ids=(9,)))
    assert masked[[4, 9]].isneginf().all() and masked[[0, 1, 2, 3, 5, 6, 7, 8]].eq(0).all()
    assert torch.equal(apply_penalties(logits, p, TokenHistory([1], [5, 6, 7], (9,))), logits)
    # greedy picks the held-back token only once min_tokens tokens are out
    peak = torch.arange(10.0)
    assert sample(peak, p, prev_tokens=TokenHistory((), [1, 2], (9,))) == 8
    assert sample(peak, p, prev_tokens=TokenHistory((), [1, 2, 3], (9,))) == 9


def test_a_large_logit_bias_forces_a_token_in_greedy_and_sampled_draws():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    for params in (SamplingParams(temperature=0, logit_bias={13: 100}),
                   SamplingParams(temperature=1.5, top_p=0.9, logit_bias={13: 100.0}, seed=5)):
        gen = torch.Generator().manual_seed(5)
        assert sample(logits, params, gen).tolist() == [13, 13, 13]
    assert sample(logits[0], SamplingParams(temperature=0, logit_bias={int(logits[0].argmax()): -100})) != int(
        logits[0].argmax())


# ---- the parameters ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("presence_penalty", 2.5, "-2 <= presence_penalty <= 2"),
        ("presence_penalty", float("nan"), "-2 <= presence_penalty <= 2"),
        ("presence_penalty", "1", "a number"),
        ("frequency_penalty", -2.01, "-2 <= frequency_penalty <= 2"),
        ("min_tokens", -1, "min_tokens >= 0"),
        ("min_tokens", 1.5, "an integer"),
        ("logit_bias", {3: 100.5}, "-100 <= bias <= 100"),
        ("logit_bias", {-1: 1.0}, "token id >= 0"),
        ("logit_bias", {"3": 1.0}, "keys are token ids"),
        ("logit_bias", {3: "up"}, "values are numbers"),
        ("logit_bias", [(3, 1.0)], "a dict"),
        ("n", 0, "n >= 1"),
        ("n", 2.0, "an integer"),
        ("prompt_logprobs", -1, "an integer 0 .. 20"),
        ("prompt_logprobs", 21, "an integer 0 .. 20"),
        ("prompt_logprobs", 2.0, "an integer or None"),
        ("prompt_logprobs", True, "an integer or None"),
    ],
)
def test_new_fields_are_validated_naming_the_parameter_and_range(field, value, allowed):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate()
    assert f"{field} = {value!r}" in str(err.value) and allowed in str(err.value) and err.value.param == field


def test_min_tokens_over_max_tokens_is_refused_by_name():
    with pytest.raises(RequestError, match=r"min_tokens = 9 is more than max_tokens = 4") as err:
        SamplingParams(min_tokens=9, max_tokens=4).validate()
    assert err.value.param == "min_tokens"
    SamplingParams(min_tokens=4, max_tokens=4).validate()


def test_validate_across_false_checks_each_value_but_leaves_min_tokens_over_max_tokens_to_the_caller():
    # the server words that rule in its request's fields (max_completion_tokens, a model default), the ranges not
    over = SamplingParams(min_tokens=9, max_tokens=4)
    assert over.validate(across=False) is over
    with pytest.raises(RequestError, match="min_tokens = -1 is out of range"):
        SamplingParams(min_tokens=-1, max_tokens=4).validate(across=False)
    with pytest.raises(RequestError, match="max_tokens = 0 is out of range"):
        SamplingParams(max_tokens=0).validate(across=False)


def test_coerce_takes_the_new_fields_and_numpy_scalars_become_python_values():
    p = SamplingParams.coerce({"presence_penalty": np.float32(0.5), "frequency_penalty": np.float64(-1),
                               "min_tokens": np.int64(2), "n": np.int32(3),
                               "logit_bias": {np.int64(7): np.float32(1.5), 8: torch.tensor(-2.0)}}).validate()
    assert (type(p.presence_penalty), type(p.frequency_penalty), type(p.min_tokens), type(p.n)) == (float, float,
                                                                                                    int, int)
    assert p.logit_bias == {7: 1.5, 8: -2.0} and all(type(k) is int and type(v) is float for k, v in
                                                     p.logit_bias.items())
    hash(p)  # logit_bias is left out of the hash: still a hashable frozen dataclass
    mine = {3: 1.0}
    q = SamplingParams(logit_bias=mine)
    mine[4] = 2.0  # the params keep their own copy
    assert q.logit_bias == {3: 1.0}


def test_choices_follow_the_seed_rule_and_wrap_at_2_64():
    seeds = [c.seed for c in SamplingParams(n=3, seed=SEED_MAX - 1).choices()]
    assert seeds == [SEED_MAX - 1, SEED_MAX, 0]
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]
    assert all(c.n == 1 for c in SamplingParams(n=4, seed=1).choices())
    one = SamplingParams(seed=3)
    assert one.choices() == [one]
    with pytest.raises(RequestError, match="seed"):
        SamplingParams(n=2, seed=-1).choices()


# ---- the engine -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_applies_the_penalties_as_computed_directly(async_scheduling):
    kw = dict(presence=0.3, frequency=0.45, repetition=1.2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.3,
                            frequency_penalty=0.45, repetition_penalty=1.2)
    want = oracle(PROMPT, 40, **kw)
    e = engine(async_scheduling=async_scheduling)
    assert final(e, params).token_ids == want
    assert want != fake_generate(PROMPT, 40, V)  # the penalties change these tokens
    counted: list[int] = []  # presence / frequency counting the prompt's tokens too: other tokens
    for _ in range(40):
        x = fake_logits(PROMPT + counted, V).float()
        for t in set(PROMPT + counted):
            x[t] = x[t] / 1.2 if x[t] > 0 else x[t] * 1.2
        for t, c in Counter(PROMPT + counted).items():
            x[t] = x[t] - 0.45 * c - 0.3
        counted.append(int(x.argmax()))
    assert counted != want  # so the engine's match shows that only the output counts


@pytest.mark.parametrize("kw", [{"presence": 2.0}, {"frequency": 2.0}, {"repetition": 3.0}])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_penalties_count_the_last_token_under_async_scheduling(kw, async_scheduling):
    """A step launched before the last token reaches the host would sample without it: such requests are never
    launched ahead (Scheduler.schedule_ahead)."""
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    params = SamplingParams(temperature=0, max_tokens=16, **{names[k]: v for k, v in kw.items()})
    want = oracle(PROMPT, 16, model=RepeatModel(V), **kw)
    assert len(set(oracle(PROMPT, 16, model=RepeatModel(V)))) == 1 and len(set(want)) > 8  # it holds them back
    assert final(engine(model=RepeatModel(V), async_scheduling=async_scheduling), params).token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_keeps_eos_and_stop_ids_out_until_reached(async_scheduling):
    full = fake_generate(PROMPT, 20, V)
    eos = full[1]  # greedy's second token: without min_tokens the request ends there
    e = engine(tokenizer=ByteTokenizer(V, eos_token_ids=(eos,)), async_scheduling=async_scheduling)
    plain = final(e, SamplingParams(temperature=0, max_tokens=20))
    assert plain.token_ids == full[:2] and plain.finish_reason == "stop"
    for m in (1, 2, 5):
        got = final(e, SamplingParams(temperature=0, max_tokens=20, min_tokens=m))
        want = oracle(PROMPT, 20, stops=(eos,), min_tokens=m, held=(eos,))
        assert got.token_ids == want and eos not in got.token_ids[:m]
    assert len(want) > 5
    stop_id = full[2]
    got = final(engine(), SamplingParams(temperature=0, max_tokens=20, min_tokens=4, stop_token_ids=[stop_id]))
    assert got.token_ids == oracle(PROMPT, 20, stops=(stop_id,), min_tokens=4, held=(stop_id,))
    assert stop_id not in got.token_ids[:4]
    # eos is held back with ignore_eos too, as in vLLM (its id is among the stop ids min_tokens masks)
    got = final(e, SamplingParams(temperature=0, max_tokens=8, min_tokens=3, ignore_eos=True))
    assert eos not in got.token_ids[:3] and got.token_ids == oracle(PROMPT, 8, min_tokens=3, held=(eos,))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_id_ends_the_request_once_min_tokens_is_reached(async_scheduling):
    full = fake_generate(PROMPT, 30, V)
    m = 2
    # an id greedy first picks after min_tokens: the mask never changed a choice, so the request ends right there
    stop = next(t for t in full[m + 1:] if t not in full[:m + 1])
    end = full.index(stop) + 1
    got = final(engine(async_scheduling=async_scheduling),
                SamplingParams(temperature=0, max_tokens=30, min_tokens=m, stop_token_ids=[stop]))
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (full[:end], "stop", stop)


def test_stop_strings_are_searched_only_after_min_tokens():
    full = fake_generate(PROMPT, 24, V)
    text = ByteTokenizer(V).decode(full)  # one character per token here
    j = next(i for i in range(len(text) - 1) if text[i : i + 2].isprintable())
    stop, end = text[j : j + 2], j + 2  # the stop string is complete with token number `end`
    e = engine()
    first = final(e, SamplingParams(temperature=0, max_tokens=24, stop=stop))
    assert first.finish_reason == "stop" and len(first.token_ids) == end
    # vLLM's rule: a stop string ends the request only through a token after the min_tokens-th
    assert final(e, SamplingParams(temperature=0, max_tokens=24, stop=stop, min_tokens=end - 1)).token_ids == \
        first.token_ids
    late = final(e, SamplingParams(temperature=0, max_tokens=24, stop=stop, min_tokens=end))
    later = [i + 2 for i in range(len(text) - 1) if text[i : i + 2] == stop and i + 2 > end]
    assert len(late.token_ids) == (later[0] if later else 24) and len(late.token_ids) > end
    assert late.finish_reason == ("stop" if later else "length")


def test_logit_bias_forces_a_token_through_the_engine():
    for params in (SamplingParams(temperature=0, max_tokens=6, logit_bias={17: 100}),
                   SamplingParams(temperature=1.0, max_tokens=6, logit_bias={17: 100}, seed=3)):
        assert final(engine(), params).token_ids == [17] * 6
    down = final(engine(), SamplingParams(temperature=0, max_tokens=6, logit_bias={t: -100 for t in
                                                                                       fake_generate(PROMPT, 6, V)}))
    assert not set(down.token_ids) & set(fake_generate(PROMPT, 6, V))


def test_logprobs_stay_those_of_the_raw_distribution():
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, logit_bias={17: 100}, presence_penalty=2.0)
    out = final(engine(), params)
    toks = PROMPT[:]
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        raw = fake_logits(toks, V).float().log_softmax(-1)
        assert lp[tok].logprob == pytest.approx(float(raw[tok]), abs=1e-5)
        assert lp[tok].rank == int((raw >= raw[tok]).sum()) > 1  # the bias picked a token the model ranks lower
        toks.append(tok)


def test_bad_requests_are_refused_by_name_while_the_others_are_served():
    e = engine()
    good = [e.add_request(prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=12,
                                                                        frequency_penalty=0.8))]
    e.step()
    with pytest.raises(RequestError, match="logit_bias token id 500 is out of range") as err:
        e.add_request(prompt_token_ids=PROMPT, params=SamplingParams(logit_bias={3: 1.0, 500: 2.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(RequestError, match="min_tokens = 7 is more than max_tokens = 3"):
        e.add_request(prompt_token_ids=PROMPT, params={"min_tokens": 7, "max_tokens": 3})
    with pytest.raises(RequestError, match="min_tokens = 100 is more than the 56 tokens"):
        e.add_request(prompt_token_ids=PROMPT, params=SamplingParams(min_tokens=100, max_tokens=None))
    with pytest.raises(RequestError, match="n = 2: one request is one sequence"):
        e.add_request(prompt_token_ids=PROMPT, params=SamplingParams(n=2))
    good.append(e.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=5)))
    done = {o.request_id: o.outputs[0] for o in e.run()}
    assert sorted(done) == sorted(good) and not e.requests
    assert done[good[0]].token_ids == oracle(PROMPT, 12, frequency=0.8)
    assert done[good[1]].token_ids == fake_generate([1, 2], 5, V)


def _spec_engine(eos: tuple[int, ...]) -> Engine:
    from tests.support.speculative import reference_verify

    model = FakeStepModel(8)  # 8 tokens: every last token was seen before, so the n-gram drafter always proposes
    model.verify = reference_verify
    return Engine(model, ByteTokenizer(8, eos_token_ids=eos), fake_config(64, 8), block_size=4, num_blocks=200,
                  drafter=NgramDrafter(n=2, k=3))


@pytest.mark.parametrize(("params", "eos"), [
    (SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.5), ()),
    (SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.3), ()),
    (SamplingParams(temperature=0, max_tokens=24, logit_bias={5: 0.6}), ()),
    (SamplingParams(temperature=0, max_tokens=24, min_tokens=9), (1,)),  # 1: greedy's second token
])
def test_speculation_leaves_these_requests_exact(params, eos):
    """They do not speculate (min_tokens: not before it is reached), so a drafter changes nothing; verifying drafts
    without their processing would give the tokens the plain parameters give, which differ."""
    copying = [1, 2, 4, 1, 2, 4, 1, 2]

    def plain(p: SamplingParams):
        return final(Engine(FakeStepModel(8), ByteTokenizer(8, eos_token_ids=eos), fake_config(64, 8), block_size=4),
                     p, copying)

    want = plain(params)
    bare = plain(dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
                                     min_tokens=0))
    assert want.token_ids != bare.token_ids
    e = _spec_engine(eos)
    got = final(e, params, copying)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert (e.stats.spec_proposed > 0) == bool(params.min_tokens)  # min_tokens reached: it speculates from there


def test_the_new_processing_adds_no_host_copy(monkeypatch):
    """Like the repetition penalty, these stay free of host syncs: the batch's one tolist() is all (ids go to the
    device without a blocking copy, counts are an index_add; on CUDA .item() or bincount would wait)."""
    from kiln.runtime.batch_sampler import sample_batch
    from kiln.runtime.sampler import make_generator

    calls = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__len__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k: calls.append(_name) or _real(self, *a, **k))
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=2, logit_bias={3: 5.0}, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=0, min_tokens=1),
              SamplingParams(temperature=0)]
    hist = [TokenHistory([1, 2], [3, 3, 4], (9,)), TokenHistory([5], [6], (9,)), TokenHistory([1], [], (9,)), ()]
    res = sample_batch(logits, params, [make_generator(p.seed) for p in params], hist)
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert res.tokens[2] == int(logits[2].index_fill(0, torch.tensor([9]), float("-inf")).argmax())
    assert res.tokens[0] == int(vllm_logits(logits[0], [1, 2], [3, 3, 4], presence=1.0, frequency=0.5,
                                            repetition=1.2).argmax())


def test_an_eos_id_past_the_vocabulary_is_not_masked_by_min_tokens():
    # a tokenizer whose eos the model cannot produce: min_tokens' mask must not index past the logits
    e = engine(tokenizer=ByteTokenizer(V, eos_token_ids=(V + 3,)))
    got = final(e, SamplingParams(temperature=0, max_tokens=5, min_tokens=2, ignore_eos=False))
    assert got.finish_reason == "length" and got.token_ids == fake_generate(PROMPT, 5, V)
