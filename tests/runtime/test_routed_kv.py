"""The engine on Mixture-of-Depths models (tiny-llama-mod: threshold routers; tiny-mistral-mod: window 8 and
predictors; seeded random weights, fp32) over the routed KV cache, against kiln's uncached causal reference
(kiln.reference.generate over the Level-1 graph, which recomputes every token's routing from scratch).

One batch of 32 mixed requests (prompts of 1 to 45 tokens, most longer than a block of 8, a third sharing a
20-token prefix) with chunked prefill under a 24-token budget: with a roomy pool (prefix caching on and off), with
a pool small enough to preempt, and the same batch run again through a warm prefix cache. Greedy tokens equal
the reference's; every routed layer's routed length c_L when a request finishes equals the number of its tokens
the reference routed there (the K/V entries that layer wrote, its shared prefix included); the routed pools hold
fewer blocks than the dense one; prefix hits happened, partial routed blocks were copied on reuse; no block leaks
in any pool (the prefix cache's entries dropped, every allocator is empty).

Routing decisions are compared exactly, so the test checks that no router score of these sequences lies within
1e-4 of its threshold (where batched and unbatched rounding could flip one) rather than hoping so.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.reference import generate
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from tests.support.routed_engine import (
    BLOCK,
    CONTEXT,
    GREEDY,
    MARGIN,
    SPECS,
    check_no_leaks,
    make_trace,
    reference_routing,
    run_engine,
)


@pytest.fixture(scope="module", params=SPECS)
def model(request):
    m = load_model(request.param, device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)  # compile_step rewrites its graph in place
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    return m, ref_gm, step


@pytest.fixture(scope="module")
def expected(model):
    return reference_run(model, make_trace())


@pytest.fixture(scope="module")
def decode_heavy(model):
    """12 requests of 5 to 20 prompt tokens and 24 new ones: mostly decode steps, which async scheduling runs ahead."""
    rng = random.Random(7)
    return reference_run(model, [([rng.randrange(512) for _ in range(rng.randint(5, 20))], 24) for _ in range(12)])


def reference_run(model, trace):
    """The reference's greedy tokens and routed counts for each (prompt, max_tokens) of a trace."""
    m, ref_gm, _ = model
    outs, counts, margin = [], [], float("inf")
    for prompt, n in trace:
        out = generate(ref_gm, prompt, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
        # The engine ran the model on every token but the last one sampled: those are its cached entries.
        c, mg = reference_routing(ref_gm, prompt + out[:-1])
        outs.append(out)
        counts.append(c)
        margin = min(margin, reference_routing(ref_gm, prompt + out)[1], mg)
    assert margin > MARGIN, f"a router score lies within {margin:.2e} of its threshold: pick another seed"
    assert all(0 < sum(c) < 2 * (len(p) + len(o) - 1) for c, (p, _), o in zip(counts, trace, outs, strict=True)), \
        "the routers should route some tokens and skip others"
    return trace, outs, counts


@pytest.mark.parametrize(("num_blocks", "preempt", "prefix"), [(None, False, True), (None, False, False),
                                                               (12, True, True)],
                         ids=["roomy", "roomy-no-prefix-cache", "preempting"])
def test_32_mixed_requests_match_the_reference_and_write_only_routed_tokens(model, expected, num_blocks, preempt,
                                                                           prefix):
    m, _, step = model
    trace, want, want_counts = expected
    engine = Engine(step, m.tokenizer, m.model, num_blocks=num_blocks, block_size=BLOCK, max_model_len=CONTEXT,
                    max_num_seqs=32, max_num_batched_tokens=24, enable_prefix_caching=prefix)
    got, lens, most = run_engine(engine, trace)
    assert got == want
    assert [lens[str(i)] for i in range(len(trace))] == want_counts  # K/V entries written = tokens routed
    st = engine.stats
    assert (st.num_preemptions > 0) == preempt
    assert most >= (3 if preempt else 6)  # continuous batching: several requests' decodes and chunks share steps
    assert max(len(p) for p, _ in trace) > 24  # so some prompts were cut into chunks
    assert (st.prefix_cache_hits > 0) == prefix  # the shared 20-token prefix: two full blocks
    bm = engine.block_manager
    assert len(bm.routed) == 2 and all(g.num_blocks < bm.num_blocks for g in bm.routed)
    assert st.routed_blocks == bm.routed[0].num_usable_blocks and st.kv_bytes < st.kv_bytes_dense
    check_no_leaks(bm)


@pytest.mark.parametrize("workload", ["mixed", "decode-heavy"])
@pytest.mark.parametrize(("num_blocks", "prefix"), [(None, True), (12, True), (None, False)],
                         ids=["roomy", "preempting", "roomy-no-prefix-cache"])
def test_async_scheduling_matches_the_reference(model, expected, decode_heavy, workload, num_blocks, prefix):
    """Steps scheduled ahead of the one in flight: their routed lengths are the recorded ones plus the step in
    flight's routed counts, added on the device (the invariants are checked only at the end: checking records the
    pending routing, and the device path would not run). The mixed batch's steps are mostly chunked prefills,
    which are not run ahead; the decode-heavy one's are mostly decodes."""
    m, _, step = model
    trace, want, want_counts = expected if workload == "mixed" else decode_heavy
    engine = Engine(step, m.tokenizer, m.model, num_blocks=num_blocks, block_size=BLOCK, max_model_len=CONTEXT,
                    max_num_seqs=32, max_num_batched_tokens=24, enable_prefix_caching=prefix, async_scheduling=True)
    assert engine.async_scheduling
    got, lens, _ = run_engine(engine, trace, check=False)
    assert got == want
    assert [lens[str(i)] for i in range(len(trace))] == want_counts
    st = engine.stats
    if workload == "mixed":
        assert (st.num_preemptions > 0) == (num_blocks is not None)
    ahead, added = st.num_steps_ahead, engine.runner.num_routing_ahead
    mostly_ahead = workload == "mixed" or num_blocks is not None or ahead > engine.num_steps / 2  # preemption: sync
    assert 0 < added <= ahead and mostly_ahead, (ahead, added, engine.num_steps)
    check_no_leaks(engine.block_manager)


def test_a_warm_prefix_cache_shares_routed_blocks_and_copies_their_partial_tails(model, expected):
    m, _, step = model
    trace, want, want_counts = expected
    engine = Engine(step, m.tokenizer, m.model, block_size=BLOCK, max_model_len=CONTEXT, max_num_seqs=32,
                    max_num_batched_tokens=24)
    first, _, _ = run_engine(engine, trace)
    bm = engine.block_manager
    hits, copies = engine.stats.prefix_cache_hits, bm.tail_copies
    second, lens, _ = run_engine(engine, [(p, n) for p, n in trace])  # every full prompt block is cached now
    assert first == second == want
    assert [lens[str(i)] for i in range(len(trace), 2 * len(trace))] == want_counts
    full = sum((len(p) - 1) // BLOCK for p, _ in trace)
    assert engine.stats.prefix_cache_hits - hits == full  # each request shared all of its prompt's full blocks
    assert bm.tail_copies - copies > len(trace) // 2  # routed tails partially filled at a boundary were copied
    assert engine.stats.num_shared_blocks == 0 and bm.routed_evictions == 0
    check_no_leaks(bm)


def test_the_routed_pools_are_sized_from_the_capacity_with_room_for_one_sequence(model):
    m, _, step = model
    roomy = Engine(step, m.tokenizer, m.model, num_blocks=201, block_size=BLOCK, max_model_len=CONTEXT)
    assert [g.num_blocks for g in roomy.block_manager.routed] == [101, 101]  # capacity 0.5 of 200, + null block
    tight = Engine(step, m.tokenizer, m.model, num_blocks=12, block_size=BLOCK, max_model_len=CONTEXT)
    assert [g.num_blocks for g in tight.block_manager.routed] == [9, 9]  # one 64-token sequence + null block
    st = roomy.stats
    layer_block = 2 * BLOCK * step.num_kv_heads * step.head_dim * 4
    assert st.kv_bytes == 201 * 2 * layer_block + 2 * 101 * layer_block
    assert st.kv_bytes_dense == 201 * 4 * layer_block and roomy.stats_dict()["kv_bytes_saved"] == 200 * layer_block


def test_a_routed_model_refuses_speculation_and_a_pool_below_one_sequence(model):
    from kiln.errors import KilnError
    from kiln.runtime.speculative import NgramDrafter

    m, _, step = model
    with pytest.raises(KilnError, match="speculative decoding is not built for Mixture-of-Depths"):
        Engine(step, m.tokenizer, m.model, block_size=BLOCK, max_model_len=CONTEXT, drafter=NgramDrafter(2, 2))
    with pytest.raises(KilnError, match="routed_num_blocks = 5: each routed layer's pool must hold one sequence"):
        Engine(step, m.tokenizer, m.model, block_size=BLOCK, max_model_len=CONTEXT, routed_num_blocks=5)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no op computes on unwritten memory
def test_the_generated_kernels_serve_a_routed_model_with_prefix_hits():
    """The same path on the generated kernels (Triton's interpreter without a GPU), small: tiny-mistral-mod (window,
    predictors), warm-up steps, chunked prefill, two requests reusing a third's prefix (a routed tail copied)."""
    m = load_model("tiny-mistral-mod", device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    shared = list(range(100, 114))
    trace = [(shared + [1, 2, 3], 4), (shared + [7], 3), ([5, 6, 7, 8, 9, 10, 11, 12, 13], 4), (shared[:9], 3)]
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
            for p, n in trace]
    assert min(reference_routing(ref_gm, p + w)[1] for (p, _), w in zip(trace, want, strict=True)) > MARGIN
    engine = Engine(step, m.tokenizer, m.model, block_size=4, max_model_len=32, max_num_batched_tokens=12,
                    max_num_seqs=4)
    engine.runner.warmup(progress=False)
    first, _, _ = run_engine(engine, trace[:1])  # its blocks are committed before the others arrive
    rest, _, _ = run_engine(engine, trace[1:])
    assert first + rest == want
    bm = engine.block_manager
    assert engine.stats.prefix_cache_hits > 0 and bm.tail_copies > 0
    check_no_leaks(bm)


def test_a_model_whose_every_layer_is_routed_has_an_empty_dense_pool():
    import dataclasses

    from kiln.ir.frontend import build_graph
    from kiln.spec.loader import load_spec

    spec = load_spec("tiny-llama-mod")
    cfg = dataclasses.replace(spec.model, route=dataclasses.replace(spec.model.route, every=1))
    ref_gm = build_graph(cfg, seed=0)
    step = compile_step(copy.deepcopy(ref_gm), cfg, spec.compile, use_kernels=False)
    assert (step.num_layers, step.num_routed_layers) == (0, 4)
    trace = make_trace(seed=3, n=6)
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=cfg.context).token_ids
            for p, n in trace]
    assert min(reference_routing(ref_gm, p + w)[1] for (p, _), w in zip(trace, want, strict=True)) > MARGIN
    engine = Engine(step, None, cfg, block_size=BLOCK, max_model_len=CONTEXT, max_num_batched_tokens=16)
    got, _, _ = run_engine(engine, trace)
    assert got == want and engine.runner.kv_cache.data.numel() == 0
    assert engine.stats.kv_bytes < engine.stats.kv_bytes_dense
    check_no_leaks(engine.block_manager)


class RoutedAsyncMachine(RuleBasedStateMachine):
    """Random adds, steps and aborts on tiny-llama-mod with async scheduling and a pool small enough to preempt:
    every request gets its final output, the invariants hold between rules (several steps run ahead inside one
    rule, so the device-side lengths are exercised), and every block of every pool comes back."""

    step_model = None

    def __init__(self):
        super().__init__()
        if RoutedAsyncMachine.step_model is None:
            m = load_model("tiny-llama-mod", device="cpu", seed=0)
            RoutedAsyncMachine.step_model = (m, compile_step(m.gm, m.model, m.compile, device="cpu",
                                                             use_kernels=False))
        m, step = RoutedAsyncMachine.step_model
        self.engine = Engine(step, m.tokenizer, m.model, num_blocks=10, block_size=BLOCK, max_model_len=CONTEXT,
                             max_num_seqs=6, max_num_batched_tokens=24, async_scheduling=True)
        self.live: set[str] = set()

    @rule(prompt=st.lists(st.integers(0, 511), min_size=1, max_size=30), n=st.integers(1, 12))
    def add(self, prompt, n):
        self.live.add(self.engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=n, **GREEDY)))

    @rule(k=st.integers(1, 6))
    def step(self, k):
        for _ in range(k):
            for out in self.engine.step():
                if out.finished:
                    self.live.discard(out.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.engine.abort(rid):
            self.live.discard(rid)

    @invariant()
    def blocks_are_accounted(self):
        self.engine.block_manager.check_invariants()

    def teardown(self):
        while self.engine.has_unfinished():
            self.step(1)
        assert not self.live, f"{sorted(self.live)} never got a final output"
        check_no_leaks(self.engine.block_manager)


RoutedAsyncMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
test_no_leak_under_random_add_step_abort_with_async_routed = RoutedAsyncMachine.TestCase
