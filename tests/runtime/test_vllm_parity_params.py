"""vLLM SamplingParams fields kiln takes too: allowed_token_ids, truncate_prompt_tokens, min_p = 1, n without a cap,
skip_special_tokens / spaces_between_special_tokens in the detokenizer (text and stop strings), the sampled (or
prompt) token first in each position's logprobs dict, and RequestOutput.num_cached_tokens; on the fake step model,
whose logits are known in closed form."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from kiln.errors import RequestError
from kiln.runtime.detokenizer import Detokenizer, TokenTextCache, added_tokens, verbatim_decoder
from kiln.runtime.engine import Engine
from kiln.runtime.logprob import Logprob, top_logprobs
from kiln.runtime.request import Request, truncate_prompt
from kiln.runtime.sampler import TokenHistory, apply_penalties, sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer, HFTokenizer
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate, fake_logits

V = 128
PROMPT = [72, 105, 33, 5, 9]


def engine(vocab: int = V, tokenizer=None, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(
        FakeStepModel(vocab), tokenizer or ByteTokenizer(vocab), fake_config(kw.pop("context", 64), vocab), **kw
    )


def final(e: Engine, params: SamplingParams, prompt=PROMPT):
    e.add_request(prompt_token_ids=prompt, params=params)
    return list(e.stream())[-1]


# ---- validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"min_p": 1.01}, "min_p"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, "x"]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
    ],
)
def test_bad_values_name_the_field_and_its_range(kw, field):
    with pytest.raises(RequestError, match=f"sampling parameter {field} = .*allowed: ") as e:
        SamplingParams(**kw).validate()
    assert e.value.param == field


@pytest.mark.parametrize("field", ["skip_special_tokens", "spaces_between_special_tokens"])
def test_the_detokenizer_options_are_bools(field):
    with pytest.raises(RequestError, match=f"{field} = 1 must be a bool \\(True or False\\), not int"):
        SamplingParams(**{field: 1}).validate()


def test_vllm_ranges_are_accepted():
    for kw in (
        {"min_p": 1.0},
        {"truncate_prompt_tokens": -1},
        {"truncate_prompt_tokens": 1},
        {"allowed_token_ids": (0,)},
        {"n": 1000},
        {"skip_special_tokens": False},
    ):
        SamplingParams(**kw).validate()
    p = SamplingParams(allowed_token_ids=torch.tensor([4, 5]))  # any sequence of ids, kept as a hashable tuple
    assert p.allowed_token_ids == (4, 5) and hash(p)
    assert len(SamplingParams(n=100, seed=1).choices()) == 100  # no cap on n, as in vLLM


def test_min_p_one_keeps_only_the_most_likely_token():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(min_p=1.0), gen) for _ in range(50)}
    assert draws == {1}


# ---- allowed_token_ids ------------------------------------------------------------------------------------------


def test_allowed_token_ids_masks_every_other_token_after_the_penalties():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(allowed_token_ids=[2, 7, 11], logit_bias={3: 50.0}, repetition_penalty=1e300)
    got = apply_penalties(logits, params, TokenHistory(prompt=[7, 3], output=[2]))
    others = [i for i in range(16) if i not in (2, 7, 11)]
    assert torch.isneginf(got[others]).all()  # the repetition penalty's clamp never makes one finite
    assert torch.isfinite(got[[2, 7, 11]]).all()
    plain = apply_penalties(
        logits, SamplingParams(repetition_penalty=1e300, logit_bias={3: 50.0}), TokenHistory(prompt=[7, 3], output=[2])
    )
    assert torch.equal(got[[2, 7, 11]], plain[[2, 7, 11]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_samples_only_allowed_ids(temperature):
    allowed = [3, 40, 41, 90]
    out = final(
        engine(),
        SamplingParams(
            temperature=temperature, max_tokens=12, ignore_eos=True, seed=5, allowed_token_ids=allowed, logprobs=2
        ),
    )
    toks = out.outputs[0].token_ids
    assert len(toks) == 12 and set(toks) <= set(allowed)
    if temperature == 0:  # greedy: the argmax over the allowed ids of the model's logits
        want, ctx = [], list(PROMPT)
        for _ in range(12):
            logits = fake_logits(ctx, V)
            tok = max(allowed, key=lambda t: float(logits[t]))
            want.append(tok)
            ctx.append(tok)
        assert toks == want
    # logprobs stay the raw distribution's, as vLLM's: the sampled token keeps its own rank
    assert all(next(iter(lp)) == t for lp, t in zip(out.outputs[0].logprobs, toks, strict=True))


def test_allowed_ids_outside_the_vocabulary_are_refused_when_added():
    with pytest.raises(RequestError, match=r"allowed_token_ids \[128, 500\] out of range .* 0 \.\. 127") as e:
        engine().add_request(prompt_token_ids=PROMPT, params=SamplingParams(allowed_token_ids=[5, 128, 500]))
    assert e.value.param == "allowed_token_ids"


def test_a_request_with_allowed_token_ids_is_not_speculated():
    req = Request("r", None, [1, 2], SamplingParams(allowed_token_ids=[1]), Detokenizer(None))
    assert not req.can_speculate
    assert Request("r", None, [1, 2], SamplingParams(), Detokenizer(None)).can_speculate


# ---- truncate_prompt_tokens -------------------------------------------------------------------------------------


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(10))
    assert truncate_prompt(ids, None, 4) == ids
    assert truncate_prompt(ids, 3, 100) == [7, 8, 9]
    assert truncate_prompt(ids, 20, 100) == ids
    assert truncate_prompt(ids, -1, 4) == [6, 7, 8, 9]  # -1: the last max_model_len
    assert truncate_prompt(torch.arange(5), 2, 9).tolist() == [3, 4]


def test_the_engine_truncates_a_prompt_that_asks_for_it():
    # the engine itself (the server and Engine users), not only LLM: a prompt longer than the context is cut to its
    # last k tokens before the length check, and the request sees the truncated prompt
    long = [7 + i % 50 for i in range(100)]
    out = final(engine(context=32), SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=20), long)
    assert out.prompt_token_ids == long[-20:] and len(out.outputs[0].token_ids) == 2
    with pytest.raises(RequestError, match="the prompt has 100 input tokens .* leaves no room to generate"):
        final(engine(context=32), SamplingParams(temperature=0, max_tokens=2), long)


# ---- logprobs order ---------------------------------------------------------------------------------------------


def test_the_sampled_token_comes_first_then_the_top_k():
    out = final(engine(), SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=3))
    comp = out.outputs[0]
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        items = list(lp.items())
        assert items[0][0] == tok  # vLLM v1's order
        ranked = sorted(((t, v) for t, v in items if v.rank <= 3), key=lambda x: x[1].rank)
        assert [v.rank for _, v in ranked] == [1, 2, 3]
        assert top_logprobs(lp, 3) == ranked and top_logprobs(lp, 2) == ranked[:2]
        assert len(lp) == 3 + (lp[tok].rank > 3)


def test_the_prompt_token_comes_first_in_prompt_logprobs():
    out = final(engine(), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert out.prompt_logprobs[0] is None
    for tok, lp in zip(PROMPT[1:], out.prompt_logprobs[1:], strict=True):
        assert next(iter(lp)) == tok and {v.rank for t, v in lp.items() if t != tok} <= {1, 2}


def test_top_logprobs_leaves_out_a_chosen_token_outside_the_top():
    lp = {9: Logprob(-5.0, 40), 1: Logprob(-0.1, 1), 2: Logprob(-0.5, 2)}
    assert [t for t, _ in top_logprobs(lp, 2)] == [1, 2] and [t for t, _ in top_logprobs(lp, 1)] == [1]
    assert [t for t, _ in top_logprobs(lp, 3)] == [1, 2]  # more than the request's k: only the top entries there are


# ---- num_cached_tokens ------------------------------------------------------------------------------------------


def test_num_cached_tokens_is_vllms_attribute():
    e = engine()
    prompt = list(range(10, 30))
    first = final(e, SamplingParams(temperature=0, max_tokens=2), prompt)
    second = final(e, SamplingParams(temperature=0, max_tokens=2), prompt)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == second.metrics.num_cached_tokens == 16  # 4 full blocks of 4


def test_num_cached_tokens_is_the_first_admissions_through_preemption():
    """vLLM sets num_cached_tokens when a request is first scheduled; its re-admission after preemption, which finds
    the request's own blocks cached, leaves it as it was (kiln summed the two)."""
    e = engine(num_blocks=14, context=44)  # 13 usable blocks of 4: two growing requests do not both fit
    prompt = list(range(10, 30))
    final(e, SamplingParams(temperature=0, max_tokens=2), prompt)  # caches the prompt's 4 full blocks
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    e.add_request(prompt_token_ids=list(range(40, 48)), params=long, request_id="c")
    e.add_request(prompt_token_ids=prompt, params=long, request_id="b")  # the later arrival: the one preempted
    outs = {o.request_id: o for o in e.stream() if o.finished}
    b = outs["b"]
    assert b.metrics.num_preemptions >= 1 and e.scheduler.num_preemptions >= 1
    assert b.num_cached_tokens == b.metrics.num_cached_tokens == 16
    assert outs["c"].num_cached_tokens == 0


# ---- skip_special_tokens / spaces_between_special_tokens --------------------------------------------------------

WORDS = 12  # ids 0 .. 11 are words, 12 .. 15 special tokens, 16 a plain added token
SV = 17


def special_tokenizer(tmp_path) -> HFTokenizer:
    """A word-level tokenizer without a decoder (tokens joined with spaces, as the `tokenizers` library does), whose
    added tokens show where spaces between special tokens go."""
    raw = RawTokenizer(models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<|a|>", "<|b|>", "<|c|>", "<|d|>"])
    raw.add_tokens(["<x>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json")


def texts(tok, ids: list[int], **kw) -> str:
    det = Detokenizer(tok, token_text=TokenTextCache(), prompt_token_ids=[1, 2])
    Request("r", None, [1, 2], SamplingParams(**kw), det)  # the request configures its detokenizer
    for t in ids:
        det.add(t)
    det.flush()
    return det.text


def test_special_tokens_text_is_kept_when_asked(tmp_path):
    tok = special_tokenizer(tmp_path)
    ids = [3, 12, 13, 4, 16, 16, 14]
    assert texts(tok, ids) == tok.decode([1, 2] + ids)[len(tok.decode([1, 2])) :] == " w3 w4 <x> <x>"
    assert texts(tok, ids, skip_special_tokens=False) == " w3 <|a|> <|b|> w4 <x> <x> <|c|>"
    # vLLM's fast detokenizer: an added token (special or not) right after another one, without the spaces before it
    assert (
        texts(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
        == " w3 <|a|><|b|> w4 <x><x><|c|>"
    )
    # skip_special_tokens True ignores spaces_between_special_tokens, as in vLLM
    assert texts(tok, ids, spaces_between_special_tokens=False) == " w3 w4 <x> <x>"


def test_verbatim_decoding_asks_the_tokenizer(tmp_path):
    """Keeping special tokens' text is the tokenizer's own decode(ids, skip_special_tokens=False) (kiln's tokenizers
    all take it); a tokenizer whose decode cannot be asked decodes as it does, with no added tokens to give."""
    tok = special_tokenizer(tmp_path)
    assert verbatim_decoder(tok)([3, 12]) == "w3 <|a|>"
    assert added_tokens(tok) == {12: "<|a|>", 13: "<|b|>", 14: "<|c|>", 15: "<|d|>", 16: "<x>"}

    class Plain:  # decode(ids) only
        eos_token_ids = ()

        def decode(self, ids):
            return tok.decode(ids)

    assert verbatim_decoder(Plain())([3, 12]) == "w3" and added_tokens(Plain()) == {}
    # the byte-level fallback has no special tokens: keeping them changes nothing, ids above 255 have no text
    byte = ByteTokenizer(300)
    assert byte.decode([104, 105, 290], skip_special_tokens=False) == byte.decode([104, 105, 290]) == "hi"
    assert verbatim_decoder(byte)([104, 105]) == "hi"


def test_the_engine_keeps_special_tokens_and_stops_on_their_text(tmp_path):
    tok = special_tokenizer(tmp_path)
    prompt = [1, 2, 3]
    full = fake_generate(prompt, 24, SV)
    specials = [i for i, t in enumerate(full) if WORDS <= t < 16]
    assert specials, f"the fake model makes no special token here: {full}"
    e = engine(SV, tok)  # one engine: the two kinds of request share its cache of token texts
    skip = final(e, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0), prompt).outputs[0]
    keep = final(
        e, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, skip_special_tokens=False), prompt
    ).outputs[0]
    head = len(tok.decode(prompt, skip_special_tokens=False))
    assert keep.token_ids == skip.token_ids == full
    assert keep.text == tok.decode(prompt + full, skip_special_tokens=False)[head:]
    assert skip.text == tok.decode(prompt + full)[len(tok.decode(prompt)) :]
    # a stop string that only special tokens' text holds ends the request where it first appears
    first = tok.decode([full[specials[0]]], skip_special_tokens=False)
    stopped = final(
        engine(SV, tok),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=first, skip_special_tokens=False),
        prompt,
    ).outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == first
    assert len(stopped.token_ids) == specials[0] + 1 and first not in stopped.text
    unseen = final(
        engine(SV, tok), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=first), prompt
    ).outputs[0]
    assert unseen.finish_reason == "length"
    # decoded_token of the logprobs follows the same option
    at = specials[0]
    assert keep.logprobs[at][full[at]].decoded_token == first and skip.logprobs[at][full[at]].decoded_token == ""
