"""Uncached reference generation."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import RequestError
from kiln.ir.frontend import build_graph
from kiln.reference import Generation, forward_logits, generate
from kiln.runtime.sampling_params import SamplingParams
from tests.support.model_configs import tiny_gpt2, tiny_llama, tiny_mistral

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llama():
    cfg = tiny_llama()
    return cfg, build_graph(cfg)


def _argmax_loop(gm, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(forward_logits(gm, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_manual_argmax_loop(llama):
    cfg, gm = llama
    gen = generate(gm, [3, 14, 15, 9], GREEDY, context=cfg.context)
    assert isinstance(gen, Generation)
    assert gen.token_ids == _argmax_loop(gm, [3, 14, 15, 9], 8)
    assert (gen.finish_reason, gen.prompt_len) == ("length", 4)
    assert gen.ttft_s > 0 and gen.decode_tokens_per_s > 0


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_mistral])
def test_greedy_deterministic_across_builds(make):
    cfg = make()
    prompt = [1, 2, 3, 4, 5, 6, 7]  # longer than mistral's window of 5
    a = generate(build_graph(cfg, seed=3), prompt, GREEDY, context=cfg.context)
    b = generate(build_graph(cfg, seed=3), prompt, GREEDY, context=cfg.context)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert all(0 <= t < cfg.vocab for t in a.token_ids)


def test_forward_logits_batch_and_dtype(llama):
    cfg, _ = llama
    gm16 = build_graph(cfg, dtype=torch.bfloat16)
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    logits = forward_logits(gm16, tokens)
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, cfg.vocab)
    # rows are independent and causal: a prefix gives the same logits as the prefix of the full sequence
    torch.testing.assert_close(forward_logits(gm16, tokens[1:, :2]), logits[1:, :2])


def test_seeded_sampling_reproducible(llama):
    cfg, gm = llama
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12)
    a = generate(gm, [1, 2], params, context=cfg.context)
    b = generate(gm, [1, 2], params, context=cfg.context)
    c = generate(gm, [1, 2], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12), context=cfg.context)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 12 tokens from a near-uniform distribution: a collision is ~impossible
    assert len(set(a.token_ids)) > 3


def test_stop_and_eos(llama):
    cfg, gm = llama
    full = generate(gm, [7, 7, 1], GREEDY, context=cfg.context).token_ids
    stop_at = full[2]
    first = full.index(stop_at)
    stopped = generate(
        gm, [7, 7, 1], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,)), context=cfg.context
    )
    assert stopped.token_ids == full[: first + 1] and stopped.finish_reason == "stop"
    eos = generate(gm, [7, 7, 1], GREEDY, context=cfg.context, eos_token_ids=[stop_at])
    assert eos.token_ids == stopped.token_ids and eos.finish_reason == "stop"
    ignored = generate(
        gm,
        [7, 7, 1],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        context=cfg.context,
        eos_token_ids=[stop_at],
    )
    assert ignored.token_ids == full and ignored.finish_reason == "length"


def test_prompt_too_long_names_numbers_and_fix(llama):
    cfg, gm = llama
    with pytest.raises(RequestError, match=r"60 tokens \+ max_tokens 8 = 68 exceeds the model context of 64") as e:
        generate(gm, [1] * 60, GREEDY, context=cfg.context)
    assert "shorten the prompt or lower max_tokens" in str(e.value)
    assert len(generate(gm, [1] * 56, GREEDY, context=cfg.context).token_ids) == 8  # exactly fits


def test_bad_prompts_rejected(llama):
    cfg, gm = llama
    with pytest.raises(RequestError, match="prompt is empty"):
        generate(gm, [], GREEDY, context=cfg.context)
    with pytest.raises(RequestError, match=r"\[97\] out of range for a vocabulary of 97"):
        generate(gm, [1, 97], GREEDY, context=cfg.context)
    with pytest.raises(RequestError, match="out of range"):
        generate(gm, [-1], GREEDY, context=cfg.context)
    with pytest.raises(RequestError, match="top_p"):
        generate(gm, [1], SamplingParams(top_p=0.0), context=cfg.context)
    # what the engine refuses, the reference path refuses alike (one check, kiln.runtime.request)
    with pytest.raises(RequestError, match="n = 3: one request is one sequence"):
        generate(gm, [1], SamplingParams(n=3), context=cfg.context)
    with pytest.raises(RequestError, match="logit_bias token id 1000000 is out of range for a vocabulary of 97"):
        generate(gm, [1], SamplingParams(logit_bias={10**6: 1.0}), context=cfg.context)
    with pytest.raises(RequestError, match=r"stop_token_ids \[97\] out of range"):
        generate(gm, [1], SamplingParams(stop_token_ids=[97]), context=cfg.context)
