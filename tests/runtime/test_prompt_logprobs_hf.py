"""prompt_logprobs of real models: a tiny random LlamaForCausalLM saved with save_pretrained and loaded by kiln (fp32,
the reference ops) against transformers, and a Mixture-of-Depths model against its own uncached Level-1 graph. At
every prompt position the prompt token's logprob is log_softmax of the oracle's logits at the position before it (to
fp32 tolerance), the top k are the oracle's most likely tokens in rank order and the rank is the oracle's; one chunk
or many, a prefix-cache hit and preemption give the same values."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.reference import forward_logits
from kiln.runtime.engine import Engine
from kiln.runtime.logprob import top_logprobs
from kiln.runtime.sampling_params import SamplingParams
from tests.support.hf_models import prompts, save_hf_model
from tests.support.routed_engine import MARGIN, reference_routing

ATOL = 2e-5  # fp32 log-probabilities of magnitude ~10 from two implementations
K = 4


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from kiln import LLM

    d = tmp_path_factory.mktemp("llama")
    model = save_hf_model("llama", d)
    return model, LLM(weights=str(d), device="cpu", dtype="fp32", use_kernels=False, max_model_len=64)


def oracle(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: [len(ids), vocab], row i predicting token i + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(ref: torch.Tensor, prompt: list[int], lps: list, k: int = K) -> None:
    assert lps[0] is None and len(lps) == len(prompt)
    for i in range(1, len(prompt)):
        row, tok, d = ref[i - 1], prompt[i], lps[i]
        assert tok in d and abs(d[tok].logprob - float(row[tok])) < ATOL, (i, d[tok], float(row[tok]))
        top = row.topk(k)
        assert next(iter(d)) == tok  # vLLM v1's order: the prompt token first, then the top k
        ranked = top_logprobs(d, k)
        ids, vals = [t for t, _ in ranked], [lp.logprob for _, lp in ranked]
        assert [lp.rank for _, lp in ranked] == list(range(1, k + 1))
        # The oracle's top k values in order; each id holds its rank's value (the same ids, up to exact ties).
        assert torch.allclose(torch.tensor(vals), top.values, atol=ATOL)
        assert all(abs(float(row[t]) - float(v)) < ATOL for t, v in zip(ids, top.values, strict=True))
        # The rank counts the tokens at least as likely, up to those within ATOL of the prompt token.
        lo, hi = int((row > row[tok] + ATOL).sum()) + 1, int((row >= row[tok] - ATOL).sum())
        assert lo <= d[tok].rank <= hi


def run(eng: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list:
    rids = [eng.add_request(prompt_token_ids=p, params=sp) for p, sp in jobs]
    final = {}
    while eng.has_unfinished():
        final |= {o.request_id: o for o in eng.step() if o.finished}
    return [final[r] for r in rids]


def engine_of(llm, **kw) -> Engine:
    return Engine(llm.step_model, llm.tokenizer, llm.loaded.model, block_size=4, **kw)


SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)


def test_prompt_logprobs_equal_transformers_in_one_chunk_or_many(hf):
    model, llm = hf
    ps = [p.tolist() for p in prompts(batch=3, length=29, seed=3)] + [prompts(batch=1, length=7, seed=4)[0].tolist()]
    whole = llm.generate(prompt_token_ids=ps, sampling_params=dict(SP.__dict__, n=2))
    for out, p in zip(whole, ps, strict=True):
        assert out.prompt_token_ids == p and len(out.outputs) == 2
        check(oracle(model, p), p, out.prompt_logprobs)
    for budget in (1, 5, 13):  # chunks of every size, boundaries everywhere
        chunked = run(engine_of(llm, num_blocks=64, max_num_batched_tokens=budget), [(p, SP) for p in ps])
        for c, w, p in zip(chunked, whole, ps, strict=True):
            check(oracle(model, p), p, c.prompt_logprobs)
            assert c.outputs[0].token_ids == w.outputs[0].token_ids
            for a, b in zip(c.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
                assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_a_cached_prefix_is_scored_again_and_gives_the_same_prompt_logprobs(hf):
    """A request still scoring its prompt takes no prefix-cache hit over unscored positions (so no cached
    token at all here), gives the values of a cold run, and the same prefix still hits for a plain request."""
    model, llm = hf
    shared = prompts(batch=1, length=20, seed=5)[0].tolist()
    a, b = shared + [40, 41, 42], shared + [50, 51]
    eng = engine_of(llm, num_blocks=64, max_num_batched_tokens=64)
    first = run(eng, [(a, SP)])[0]
    again, other = run(eng, [(a, SP)])[0], run(eng, [(b, SP)])[0]
    plain = run(eng, [(b, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])[0]
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.metrics.num_cached_tokens == other.metrics.num_cached_tokens == 0 < plain.metrics.num_cached_tokens
    check(oracle(model, a), a, first.prompt_logprobs)
    check(oracle(model, b), b, other.prompt_logprobs)
    assert plain.outputs[0].token_ids == other.outputs[0].token_ids


def test_preemption_keeps_every_prompt_position_once(hf):
    """A pool of 19 usable blocks of 4 for 5 requests of 26 + 20 tokens, prefilled 8 tokens a step: some are
    preempted with their prompt part scored (and resume scoring where they stopped), some after it."""
    model, llm = hf
    ps = [p.tolist() for p in prompts(batch=5, length=26, seed=6)]
    eng = engine_of(llm, num_blocks=20, max_num_batched_tokens=8)
    scoring, preempt = [], eng.scheduler.preempt
    eng.scheduler.preempt = lambda req: (scoring.append(req.unscored_from is not None), preempt(req))
    outs = run(eng, [(p, dict(SP.__dict__, max_tokens=20)) for p in ps])
    assert any(scoring) and not all(scoring)
    for out, p in zip(outs, ps, strict=True):
        check(oracle(model, p), p, out.prompt_logprobs)


@pytest.mark.parametrize("spec", ["tiny-llama-mod", "tiny-mistral-mod"])
def test_routed_model_prompt_logprobs_equal_its_uncached_graph(spec):
    """Routed layers cache only their routed tokens; the prompt positions' logits still equal the Level-1 graph's
    (whose routing is recomputed from scratch), in chunks of 5, the second request after the first (whose shared
    prefix it may not take from the cache while scoring it)."""
    m = load_model(spec, device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)  # compile_step rewrites its graph in place
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(512, (17,), generator=g).tolist()
    ps = [shared + torch.randint(512, (n,), generator=g).tolist() for n in (9, 14)]
    for p in ps:
        assert reference_routing(ref_gm, p)[1] > MARGIN, "a router score lies near its threshold: pick another seed"
    eng = Engine(step, None, m.model, block_size=8, num_blocks=64, max_num_batched_tokens=5)
    outs = run(eng, [(ps[0], SP)]) + run(eng, [(ps[1], SP)])
    for out, p in zip(outs, ps, strict=True):
        check(forward_logits(ref_gm, torch.tensor([p]))[0].log_softmax(-1), p, out.prompt_logprobs)


def test_a_16bit_model_keeps_the_prompt_rows_logits_in_its_dtype(monkeypatch):
    """The step model returns the rows in the model's dtype (bf16 here): only the sampled rows and one block of
    prompt rows at a time are taken to fp32, so a long prompt's [tokens, vocab] logits never exist in fp32 whole."""
    import kiln.runtime.engine as engine_mod

    m = load_model("tiny-llama", device="cpu", seed=0, dtype="bf16")
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    seen = []
    launch = engine_mod.launch_prompt
    monkeypatch.setattr(engine_mod, "launch_prompt", lambda rows: (seen.append(rows.logits.dtype), launch(rows))[1])
    eng = Engine(step, m.tokenizer, m.model, max_num_seqs=2)
    out = run(eng, [(list(range(3, 40)), SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0))])[0]
    assert seen == [torch.bfloat16] and len(out.prompt_logprobs) == 37
