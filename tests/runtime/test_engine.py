"""The engine on tiny-llama (seeded random weights) against the uncached reference path: greedy outputs are
identical for one request, 48 in one continuous batch, the same 48 under preemption, and requests sharing a
long prefix through the prefix cache. The compiled step model runs on the reference ops (use_kernels=False),
except in one small test that runs the generated kernels (in Triton's interpreter without a GPU)."""

from __future__ import annotations

import copy
import random

import pytest

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.reference import generate
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    m = load_model("tiny-llama", device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)  # compile_step rewrites its graph in place
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    return m, ref_gm, step


@pytest.fixture(scope="module")
def trace():
    rng = random.Random(1)
    return [([rng.randrange(512) for _ in range(rng.randint(1, 80))], rng.randint(1, 12)) for _ in range(48)]


@pytest.fixture(scope="module")
def reference(tiny, trace):
    m, ref_gm, _ = tiny
    return [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
            for p, n in trace]


def run_all(engine: Engine, trace, params=None) -> tuple[list[list[int]], dict]:
    """Add every request, step to the end checking the KV waste bound; token ids in trace order."""
    ids = [engine.add_request(prompt_token_ids=p, params=params or SamplingParams(max_tokens=n, **GREEDY))
           for p, n in trace]
    done, seen = {}, {"max_running": 0, "max_shared": 0}
    bs = engine.block_manager.block_size
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        waste = engine.kv_waste()
        assert all(0 <= w < bs for w in waste), f"KV waste of a running sequence reached a block: {waste}"
        seen["max_running"] = max(seen["max_running"], len(waste))
        seen["max_shared"] = max(seen["max_shared"], engine.block_manager.num_shared_blocks())
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts)
    return [done[i] for i in ids], seen


def test_one_request_matches_the_reference(tiny, trace, reference):
    m, _, step = tiny
    for k in (0, 5):
        got, _ = run_all(Engine(step, m.tokenizer, m.model), [trace[k]])
        assert got == [reference[k]]


def test_48_requests_in_one_continuous_batch_match_the_reference(tiny, trace, reference):
    m, _, step = tiny
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=48, max_num_batched_tokens=512)
    got, seen = run_all(engine, trace)
    assert got == reference
    assert seen["max_running"] > 24  # really batched
    assert engine.stats.num_preemptions == 0


def test_48_requests_under_preemption_match_the_reference(tiny, trace, reference):
    m, _, step = tiny
    # 20 usable blocks of 16 tokens: one full-context sequence fits, 48 requests do not.
    engine = Engine(step, m.tokenizer, m.model, num_blocks=21, max_num_seqs=48, max_num_batched_tokens=256)
    got, _ = run_all(engine, trace)
    assert engine.stats.num_preemptions > 0
    assert got == reference


def test_padded_decode_batches_match_the_reference(tiny, trace, reference):
    """The CUDA-graph batch layout (decodes padded to 1, 2, 4, ... rows on the null block), run eagerly."""
    m, _, step = tiny
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=12, pad_decode_batches=True)
    got, _ = run_all(engine, trace[:12])
    assert got == reference[:12]


def test_shared_prefix_is_served_from_the_prefix_cache(tiny):
    m, ref_gm, step = tiny
    rng = random.Random(2)
    prefix = [rng.randrange(512) for _ in range(70)]
    trace = [(prefix + [rng.randrange(512) for _ in range(rng.randint(1, 9))], 6) for _ in range(6)]
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=256).token_ids for p, n in trace]
    engine = Engine(step, m.tokenizer, m.model)
    first = engine.add_request(prompt_token_ids=trace[0][0], params=SamplingParams(max_tokens=6, **GREEDY))
    engine.step()  # the first prompt's full blocks are now written and cached
    got, seen = run_all(engine, trace[1:])
    assert got == want[1:]
    assert engine.stats.prefix_cache_hits >= 5 * 4  # 4 full blocks of the 70-token prefix, for 5 requests
    assert seen["max_shared"] >= 4
    del first


def test_seeded_sampling_matches_the_reference_whatever_the_batch(tiny, trace):
    m, ref_gm, step = tiny
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=8, seed=s, ignore_eos=True) for s in (3, 4, 5)]
    want = [generate(ref_gm, trace[i][0], p, context=256).token_ids for i, p in enumerate(params)]
    engine = Engine(step, m.tokenizer, m.model)
    ids = [engine.add_request(prompt_token_ids=trace[i][0], params=p) for i, p in enumerate(params)]
    for p, n in trace[3:10]:  # greedy neighbours in the same batch change nothing
        engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, **GREEDY))
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    assert [done[i] for i in ids] == want


def test_generated_kernels_match_the_reference(trace):
    """The one engine test on the generated kernels (Triton's interpreter on CPU): a short request."""
    m = load_model("tiny-llama", device="cpu", seed=0)
    prompt = trace[2][0][:20]
    want = generate(m.gm, prompt, SamplingParams(max_tokens=3, **GREEDY), context=256).token_ids
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    got, _ = run_all(Engine(step, m.tokenizer, m.model, max_num_seqs=2), [(prompt, 3)])
    assert got == [want]


HEAD_DIM_8 = """model "hd8" {
  vocab = 97
  dim = 32
  layers = 1
  heads = 4
  kv_heads = 2
  head_dim = 8
  ffn = 64
  context = 64
  norm = rms(eps = 1e-05)
  rope = rope(theta = 10000)
  layer {
    x = x + attention(norm(x), causal = true)
    x = x + mlp(norm(x), act = swiglu)
  }
}
"""


def test_generated_kernels_serve_a_head_dim_below_16(tmp_path):
    """Tiny HF test checkpoints have head_dim 4 or 8: the paged kernels mask the head up to tl.dot's K of 16."""
    (tmp_path / "hd8.kiln").write_text(HEAD_DIM_8)
    m = load_model(str(tmp_path / "hd8.kiln"), device="cpu", seed=0)
    prompts = [[5, 17, 3, 88, 41, 2, 9, 60, 33, 12, 70, 1, 4, 95, 23, 8, 50], [7, 7, 30]]
    want = [generate(m.gm, p, SamplingParams(max_tokens=4, **GREEDY), context=64).token_ids for p in prompts]
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    got, _ = run_all(Engine(step, m.tokenizer, m.model, max_num_seqs=2, block_size=4), [(p, 4) for p in prompts])
    assert got == want


@pytest.mark.gpu
def test_cuda_graph_decodes_match_the_reference(trace):
    """On CUDA: generated kernels, decode steps replayed from captured graphs (padded batch sizes)."""
    m = load_model("tiny-llama", device="cuda", seed=0)
    ref_gm = copy.deepcopy(m.gm)
    step = compile_step(m.gm, m.model, m.compile, device="cuda", use_kernels=True)
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=8, use_cuda_graphs=True)
    assert sorted(engine.runner.graphs) == [1, 2, 4, 8], "CUDA graph capture failed (see stderr)"
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=256).token_ids for p, n in trace[:6]]
    got, _ = run_all(engine, trace[:6])
    assert got == want


def test_logprobs_for_one_request_leave_its_batch_mate_unchanged(tiny, monkeypatch):
    import kiln.runtime.batch_sampler as sampler

    _, _, step = tiny
    calls = []
    real = sampler._with_logprobs
    monkeypatch.setattr(sampler, "_with_logprobs", lambda rows, *a: calls.append(rows.shape[0]) or real(rows, *a))
    prompts = [[5, 17, 301, 44], [9, 8, 7, 6, 5, 4]]

    def run(asked: bool):
        engine = Engine(step, None, tiny[0].model, num_blocks=32)
        a = engine.add_request(prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=6, **GREEDY))
        b = engine.add_request(prompt_token_ids=prompts[1], params=SamplingParams(
            max_tokens=3, logprobs=3 if asked else None, **GREEDY))
        outs, deltas = {}, {a: [], b: []}
        for out in engine.stream():
            deltas[out.request_id] += out.outputs[0].delta_logprobs or []
            if out.finished:
                outs[out.request_id] = out.outputs[0]
        return outs[a], outs[b], deltas[b]

    plain_a, plain_b, _ = run(asked=False)
    assert not calls  # nobody asked: the sampler never computed a log-probability
    a, b, b_deltas = run(asked=True)
    assert calls == [2, 2, 2]  # only the 3 steps that sampled b (batches of 2 rows, 1 asking)
    assert (a.token_ids, b.token_ids) == (plain_a.token_ids, plain_b.token_ids)
    assert a.logprobs is None and a.delta_logprobs is None
    assert len(b.logprobs) == 3 and b_deltas == b.logprobs
    for tok, lp in zip(b.token_ids, b.logprobs, strict=True):
        assert len(lp) == 3 and next(iter(lp)) == tok  # greedy: the sampled token ranks first
        vals = [v.logprob for v in lp.values()]
        assert lp[tok].logprob == max(vals) <= 0 and vals == sorted(vals, reverse=True)
        assert [v.rank for v in lp.values()] == [1, 2, 3] and lp[tok].rank == 1


def test_cuda_graphs_asked_for_on_cpu_are_named_not_silently_dropped(tiny, caplog):
    m, _, step = tiny
    with caplog.at_level("WARNING", logger="kiln"):
        Engine(step, m.tokenizer, m.model, max_num_seqs=2, use_cuda_graphs=True)
    assert "use_cuda_graphs=True has no effect on a cpu model (CUDA graphs need CUDA)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln"):
        Engine(step, m.tokenizer, m.model, max_num_seqs=2)  # the default picks eager decoding there, quietly
    assert "use_cuda_graphs" not in caplog.text
