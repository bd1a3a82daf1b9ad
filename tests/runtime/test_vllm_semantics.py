"""Where kiln follows vLLM's request semantics (on a fake step model): a stop token's text stays out of the output
text unless include_stop_str_in_output, max_tokens None runs to the context, top_k -1 is off, cumulative_logprob,
a seed gives the same tokens in any batch even when speculation is on, and engine arguments are checked."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import NgramDrafter
from kiln.tokenizer import ByteTokenizer
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate

V = 128
PROMPT = [72, 105, 33]


def engine(**kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(FakeStepModel(V), kw.pop("tokenizer", ByteTokenizer(V)), fake_config(kw.pop("context", 64), V),
                  **kw)


def run(e: Engine, params: SamplingParams, prompt=PROMPT) -> tuple[object, str]:
    """The final output of one request, and its streamed text."""
    e.add_request(prompt_token_ids=prompt, params=params)
    streamed, final = "", None
    for out in e.stream():
        streamed += out.outputs[0].delta_text
        final = out.outputs[0]
    return final, streamed


@pytest.mark.parametrize("with_stop_strings", [False, True])  # stop strings detokenize as tokens come
@pytest.mark.parametrize("eos", [False, True])
def test_the_stop_tokens_text_is_left_out_unless_asked_for(with_stop_strings, eos):
    full = fake_generate(PROMPT, 20, V)
    stop_tok, cut = full[5], full.index(full[5]) + 1  # ends at the first time it is sampled
    tok = ByteTokenizer(V, eos_token_ids=(stop_tok,) if eos else ())
    extra = {"stop": ("never-in-the-text",)} if with_stop_strings else {}
    ids = {} if eos else {"stop_token_ids": [stop_tok]}
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=20, include_stop_str_in_output=include, **ids, **extra)
        final, streamed = run(engine(tokenizer=tok), params)
        # vLLM's stop_reason: the stop_token_ids id that ended it, None for eos
        assert final.finish_reason == "stop" and final.stop_reason == (None if eos else stop_tok)
        assert final.token_ids == full[:cut]  # the token itself is in token_ids, as in vLLM
        want = tok.decode(full[:cut] if include else full[: cut - 1])
        assert final.text == streamed == want


def test_include_stop_str_in_output_keeps_the_stop_string():
    full = fake_generate(PROMPT, 20, V)
    text = ByteTokenizer(V).decode(full)
    stop = text[6:8]
    final, streamed = run(engine(), SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                   include_stop_str_in_output=True))
    assert final.text == streamed == text[: text.index(stop) + len(stop)] and final.stop_reason == stop


def test_max_tokens_none_runs_to_the_context():
    final, _ = run(engine(context=64), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert final.finish_reason == "length" and len(final.token_ids) == 64 - len(PROMPT)
    assert final.token_ids == fake_generate(PROMPT, 64 - len(PROMPT), V)
    # an engine's max_model_len below the model's context bounds it
    final, _ = run(engine(context=64, num_blocks=17, max_model_len=40), SamplingParams(temperature=0, max_tokens=None))
    assert len(final.token_ids) == 40 - len(PROMPT)


def test_top_k_minus_one_is_off():
    assert SamplingParams(top_k=-1).validate().top_k == 0
    a, _ = run(engine(), SamplingParams(temperature=1.0, top_k=-1, seed=3, max_tokens=12))
    b, _ = run(engine(), SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=12))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_cumulative_logprob_is_the_sum_of_the_tokens_logprobs(kind):
    e = engine()
    e.add_request(prompt_token_ids=PROMPT, params=SamplingParams(seed=1, max_tokens=9, logprobs=2, output_kind=kind))
    ids, lps, last = [], [], None
    for out in e.stream():
        o = out.outputs[0]
        ids += o.delta_token_ids
        lps += o.delta_logprobs
        assert o.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(lps, ids, strict=True)))
        last = o
    assert len(ids) == 9 and last.cumulative_logprob < 0
    plain, _ = run(engine(), SamplingParams(seed=1, max_tokens=9))
    assert plain.cumulative_logprob is None and plain.token_ids == ids  # only with logprobs asked


def _spec_engine(max_batch: int) -> Engine:
    from tests.support.speculative import reference_verify

    model = FakeStepModel(8)  # 8 tokens: every last token was seen before, so the n-gram drafter always proposes
    model.verify = reference_verify
    return Engine(model, None, fake_config(64, 8), block_size=4, num_blocks=400, max_num_seqs=48,
                  drafter=NgramDrafter(n=2, k=3), speculation_max_batch=max_batch)


def _tokens(e: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    ids = [e.add_request(prompt_token_ids=p, params=q) for p, q in zip(prompts, params, strict=True)]
    done = {o.request_id: o.outputs[0].token_ids for o in e.run()}
    return {i: done[i] for i in ids}


def test_a_seeded_request_gets_the_same_tokens_in_any_batch_with_speculation_on(caplog):
    """Speculation turns itself off above speculation_max_batch, and verification draws from the generator
    differently from plain sampling: a seeded request therefore does not speculate unless it asks to."""
    seeded = SamplingParams(temperature=0.8, seed=99, max_tokens=24, ignore_eos=True)
    copying = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    alone = _tokens(_spec_engine(4), [copying], [seeded])
    others = [[i % 5, 7, i % 3] for i in range(40)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    crowd = _tokens(_spec_engine(4), [copying, *others], [seeded] + [greedy] * 40)
    assert list(crowd.values())[0] == list(alone.values())[0]
    e = _spec_engine(4)
    _tokens(e, [copying], [seeded])
    assert e.stats.spec_proposed == 0  # seeded sampling: not speculated by default, and the engine says so once
    assert "seeded sampling requests are not speculated" in caplog.text
    e = _spec_engine(4)
    _tokens(e, [copying], [SamplingParams(temperature=0.8, seed=99, max_tokens=24, speculate=True)])
    assert e.stats.spec_proposed > 0  # ... unless it asks (its tokens then depend on when speculation runs)
    e = _spec_engine(4)
    _tokens(e, [copying], [SamplingParams(temperature=0.8, max_tokens=24)])
    assert e.stats.spec_proposed > 0  # unseeded sampling speculates


@pytest.mark.parametrize(("kw", "needle"), [
    ({"num_blocks": "100"}, "num_blocks = '100' must be an integer, not str"),
    ({"num_blocks": -5}, "num_blocks = -5 is out of range"),
    ({"max_num_seqs": True}, "max_num_seqs = True must be an integer, not bool"),
    ({"max_model_len": 0}, "max_model_len = 0 is out of range"),
    ({"max_model_len": "x"}, "max_model_len = 'x' must be an integer"),
    ({"max_model_len": 65}, "max_model_len = 65 is longer than the model's context of 64"),
    ({"block_size": 2.0}, "block_size = 2.0 must be an integer"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization = '0.5' must be a number"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching = 'yes' must be True, False or None"),
])
def test_engine_arguments_are_checked_by_name(kw, needle):
    with pytest.raises(KilnError) as err:
        engine(context=64, **kw)
    assert needle in str(err.value)


class RaisingDecode(ByteTokenizer):
    """decode([id]) raises for the ids in `bad` alone (slow sentencepiece tokenizers raise on some ids), so only a
    Logprob's decoded_token for one of them can fail, never the output's own text."""

    def __init__(self, vocab: int, bad: set[int]):
        super().__init__(vocab)
        self.bad = bad

    def decode(self, ids):
        if len(ids) == 1 and ids[0] in self.bad:
            raise IndexError(f"piece id {ids[0]} is out of range")
        return super().decode(ids)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_an_alternative_whose_text_fails_to_decode_gets_none_and_fails_nothing(kind):
    """decoded_token is made for every top-k alternative and prompt entry, tokens no output carries: a decode that
    raises for one leaves it None; the request and its batch mates end normally, cumulative_logprob intact."""
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=4, output_kind=kind)
    plain, _ = run(engine(), sp)
    alternatives = {t for d in plain.logprobs for t in d} - set(plain.token_ids) - set(PROMPT)
    bad = set(sorted(alternatives)[:2])
    e = engine(tokenizer=RaisingDecode(V, bad))
    mate = e.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=5))
    rid = e.add_request(prompt_token_ids=PROMPT, params=sp)
    outs: dict[str, list] = {}
    for out in e.stream():
        outs.setdefault(out.request_id, []).append(out)
    got = outs[rid][-1].outputs[0]
    assert outs[mate][-1].outputs[0].finish_reason == "length" and got.finish_reason == "length"
    lps = [d for o in outs[rid] for d in o.outputs[0].delta_logprobs or []] if kind == "delta" else got.logprobs
    prompt_lps = outs[rid][0].prompt_logprobs
    assert got.cumulative_logprob == pytest.approx(plain.cumulative_logprob)
    seen = [(t, v.decoded_token) for d in lps + prompt_lps[1:] for t, v in d.items()]
    assert {t for t, text in seen if text is None} == bad & {t for t, _ in seen} != set()
    assert all(text == chr(t) for t, text in seen if t not in bad)
