"""Padded decode batches (the CUDA-graph input shape, run eagerly) on Mixture-of-Depths models.

A pure-decode step of a routed model is padded to the next captured batch size (1, 2, 4, 8 here) like a dense
model's: each padding row is a one-token dummy sequence on the null block, with routed length 0 and null routed
tables. Its router sees the dummy token and routes it in the second routed layer of both tiny MoD specs (token 0
at position 0 scores above the threshold there), so kiln::mod_kv_slots must send it to that routed pool's null
block, and the host must not record it.

The padded engine must give the unpadded engine's greedy tokens and routed lengths (which the uncached reference's
routing confirms) on the mixed trace (tests/support/routed_engine.make_trace), with a roomy pool and a warm prefix
cache, and under preemption. A watch around the step model checks every step: padding rows carry routed length 0 and
null tables; with every pool's null block poisoned (NaN) before the step, the entries that changed are exactly the
real rows' slots (dense, and per routed layer from the step's routed flags) plus entry 0 of the null block, which
is written iff a padding row ran through that pool; the pools start all NaN, so a real row that read an entry no
real row wrote (a null block included) would turn its logits to NaN.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.reference import generate
from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.engine import Engine
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.step import KVCache, StepBatch
from tests.support.routed_engine import (
    BLOCK,
    CONTEXT,
    GREEDY,
    MARGIN,
    SPECS,
    RoutingDecisions,
    check_no_leaks,
    make_trace,
    reference_routing,
    run_engine,
)

NAN = float("nan")
Slots = set[tuple[int, int]]


def changed(before: torch.Tensor, after: torch.Tensor) -> Slots:
    """(block, offset) of the entries of a pool [layers, 2, blocks, block_size, heads, dim] that differ (NaN = NaN)."""
    same = (before == after) | (before.isnan() & after.isnan())
    diff = (~same).flatten(4).any(-1).any(1).any(0)
    return {(int(b), int(o)) for b, o in diff.nonzero().tolist()}


class WriteWatch:
    """Stands in for a runner's step model: checks each step's padding inputs and where its K/V went."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.model, self.bs = runner, runner.model, runner.block_size
        self.real = 0  # real sequences of the step being run (padding rows follow them)
        self.padded: list[tuple[int, int]] = []  # (real, padded) sequences of each padded step
        self.padding_routed = [0] * runner.num_routed  # steps in which a padding row was routed, per routed layer
        prepare = runner.prepare

        def spy(sched, tokens=None, prompt=None):
            self.real = len(sched.seqs)
            return prepare(sched, tokens, prompt)

        runner.prepare = spy
        runner.model = self

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, batch: StepBatch, cache: KVCache):
        s, real = batch.num_seqs, self.real
        cache.data[:, :, NULL_BLOCK] = NAN
        cache.routed[:, :, NULL_BLOCK] = NAN
        before = cache.data.clone(), cache.routed.clone()
        logits, flags = self.model(batch, cache)
        qsl = batch.query_start_loc.tolist()
        n = qsl[real]  # the real rows
        if s > real:
            self.padded.append((real, s))
            assert (batch.routed_lens[:, real:] == 0).all()
            assert (batch.routed_block_tables[:, real:] == NULL_BLOCK).all()
            assert (batch.block_tables[real:] == NULL_BLOCK).all() and batch.num_tokens == n + s - real
        dense = {(int(x) // self.bs, int(x) % self.bs) for x in batch.slot_mapping[:n]}
        if cache.data.shape[0]:
            self.check(changed(before[0], cache.data), dense, s > real)
        lens, tables = batch.routed_lens.tolist(), batch.routed_block_tables.tolist()
        for j, f in enumerate(flags.tolist()):
            want = set()
            for i in range(real):
                rows = [r for r in range(qsl[i], qsl[i + 1]) if f[r]]
                entries = range(lens[j][i], lens[j][i] + len(rows))
                want |= {(tables[j][i][e // self.bs], e % self.bs) for e in entries}
            pad = any(f[n:])
            self.padding_routed[j] += pad
            self.check(changed(before[1][j : j + 1], cache.routed[j : j + 1]), want, pad)
        return logits, flags

    @staticmethod
    def check(got: Slots, real: Slots, padding: bool) -> None:
        """got: the entries a step changed in a pool; real: its real rows' slots (none in the null block), which
        may rewrite an entry with the value it had (a preempted request recomputed into the same block)."""
        null = (NULL_BLOCK, 0)
        assert all(b != NULL_BLOCK for b, _ in real)
        assert (null in got) == padding, "the null block's entry 0 is written iff a padding row ran through the pool"
        assert got - {null} <= real, f"written outside the real rows' slots: {sorted(got - {null} - real)}"


class StaticInputs:
    """Stands in for a runner's step model: runs each decode batch of a captured size the way a CUDA-graph replay
    does, but eagerly on CPU: copied (StepGraphs.fill) into views of the graphs' static buffers (full-width
    tables whose columns past the batch's keep earlier steps' blocks, strided routed views, max_context_len the
    model's context) and the step run on those views."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.model, self.replays = runner, runner.model, 0
        self.graphs = runner.make_graphs()
        runner.model = self

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, batch: StepBatch, cache: KVCache):
        b = batch.num_seqs
        if batch.max_query_len != 1 or b not in self.runner.pad_sizes or batch.num_tokens != b:
            return self.model(batch, cache)
        static = self.graphs.views(b, 1)
        self.graphs.fill(static, batch)
        self.replays += 1
        return self.model(static, cache)


@pytest.fixture(scope="module", params=SPECS)
def model(request):
    m = load_model(request.param, device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)
    return m, ref_gm, compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)


def make_engine(model, **kw) -> Engine:
    m, _, step = model
    return Engine(step, m.tokenizer, m.model, block_size=BLOCK, max_model_len=CONTEXT, max_num_seqs=8,
                  max_num_batched_tokens=24, **kw)


def staggered(seed: int = 5, n: int = 7) -> list[tuple[list[int], int]]:
    """n requests admitted together whose outputs end one after the other: decode steps of n, n - 1, ... 1 rows."""
    rng = random.Random(seed)
    return [([rng.randrange(512) for _ in range(rng.randint(3, 12))], 8 + 4 * i) for i in range(n)]


def run(engine: Engine, trace) -> tuple[list[list[int]], list[list[int]]]:
    """run_engine's tokens and each request's final routed lengths, in trace order."""
    got, lens, _ = run_engine(engine, trace)
    return got, list(lens.values())


@pytest.fixture(scope="module")
def unpadded(model):
    """The traces' tokens and final routed lengths from the unpadded engine; its routed lengths are the reference's
    routing counts, and no router score lies within MARGIN of its threshold (so batch shapes cannot flip one)."""
    _, ref_gm, _ = model
    engine = make_engine(model)
    out = {}
    for name, trace in (("mixed", make_trace()), ("staggered", staggered())):
        got, lens = run(engine, trace)
        for (prompt, _), toks, c in zip(trace, got, lens, strict=True):
            assert c == reference_routing(ref_gm, prompt + toks[:-1])[0]
            assert reference_routing(ref_gm, prompt + toks)[1] > MARGIN, "a score near its threshold: another seed"
        out[name] = trace, got, lens
    return out


def poisoned(engine: Engine) -> WriteWatch:
    engine.runner.kv_cache.data.fill_(NAN)
    engine.runner.kv_cache.routed.fill_(NAN)
    return WriteWatch(engine.runner)


def test_padded_decodes_match_the_unpadded_engine_and_write_padding_only_to_the_null_blocks(model, unpadded):
    engine = make_engine(model, pad_decode_batches=True)
    watch = poisoned(engine)
    for name in ("mixed", "staggered"):
        trace, want, want_lens = unpadded[name]
        assert run(engine, trace) == (want, want_lens)
    assert {3, 5, 7} <= {real for real, _ in watch.padded} and {4, 8} <= {s for _, s in watch.padded}
    assert watch.padding_routed[0] == 0 < watch.padding_routed[1]  # token 0 routes in the second routed layer
    bm = engine.block_manager
    hits, copies, steps = engine.stats.prefix_cache_hits, bm.tail_copies, len(watch.padded)
    trace, want, want_lens = unpadded["mixed"]
    assert run(engine, trace) == (want, want_lens)  # through the warm prefix cache: shared blocks, copied tails
    assert engine.stats.prefix_cache_hits > hits and bm.tail_copies > copies and len(watch.padded) > steps
    check_no_leaks(bm)


def test_padded_decodes_under_preemption_match_the_unpadded_engine(model, unpadded):
    engine = make_engine(model, pad_decode_batches=True, num_blocks=12)
    watch = poisoned(engine)
    for name in ("mixed", "staggered"):
        trace, want, want_lens = unpadded[name]
        preempted = engine.stats.num_preemptions
        assert run(engine, trace) == (want, want_lens)
        assert engine.stats.num_preemptions > preempted
    assert {3, 5} <= {real for real, _ in watch.padded}
    check_no_leaks(engine.block_manager)


def test_decodes_from_the_graphs_static_buffers_match_the_unpadded_engine(model, unpadded):
    """What a replay reads, run on CPU: the routed lengths and tables in the static buffers, stale columns and all."""
    engine = make_engine(model, pad_decode_batches=True, num_blocks=24)
    static = StaticInputs(engine.runner)
    watch = poisoned(engine)  # checks the batch as prepared; the step then runs on the static views
    for name in ("mixed", "staggered", "mixed"):
        trace, want, want_lens = unpadded[name]
        assert run(engine, trace) == (want, want_lens)
    assert static.replays > 20 and {3, 5, 7} <= {real for real, _ in watch.padded}
    wide = static.graphs.static.routed_block_tables
    assert wide.shape[2] == engine.runner.max_blocks_per_seq and (wide != NULL_BLOCK).any()
    check_no_leaks(engine.block_manager)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no op computes on unwritten memory
def test_the_generated_kernels_serve_padded_routed_decodes():
    """The same on the generated kernels (Triton's interpreter without a GPU), small: tiny-mistral-mod (window,
    predictors), three requests decoding together (padded to 4), then two, then one (not padded)."""
    m = load_model("tiny-mistral-mod", device="cpu", seed=0)
    ref_gm = copy.deepcopy(m.gm)
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    trace = [(list(range(100, 111)), 6), ([5, 6, 7, 8, 9], 4), ([40, 41, 42, 43, 44, 45, 46], 2)]
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
            for p, n in trace]
    assert min(reference_routing(ref_gm, p + w)[1] for (p, _), w in zip(trace, want, strict=True)) > MARGIN
    engine = Engine(step, m.tokenizer, m.model, block_size=4, max_model_len=32, max_num_batched_tokens=32,
                    max_num_seqs=4, pad_decode_batches=True)
    watch = poisoned(engine)
    got, _, _ = run_engine(engine, trace)
    assert got == want and (3, 4) in watch.padded and watch.padding_routed[1] > 0
    check_no_leaks(engine.block_manager)


def cuda_routing(gm, tokens: list[int]) -> tuple[list[int], float]:
    """reference_routing for a Level-1 graph on the GPU."""
    interp = RoutingDecisions(gm)
    with torch.inference_mode():
        interp.run(torch.tensor([tokens], device="cuda"), torch.arange(len(tokens), device="cuda")[None])
    counts = [int((score > thr).sum()) for score, thr in interp.seen]
    return counts, min(float((score - thr).abs().min()) for score, thr in interp.seen)


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_graph_decodes_of_a_routed_model_match_the_reference(spec, ahead):
    """On CUDA: generated kernels, decode steps of a routed model replayed from captured graphs (padded sizes);
    async: launched ahead of the step in flight, its routed counts added to their routed lengths on the device
    (the invariants then checked at the end only: checking records the step in flight)."""
    m = load_model(spec, device="cuda", seed=0)
    ref_gm = copy.deepcopy(m.gm)
    step = compile_step(m.gm, m.model, m.compile, device="cuda", use_kernels=True)
    engine = Engine(step, m.tokenizer, m.model, block_size=BLOCK, max_model_len=CONTEXT, max_num_seqs=8,
                    max_num_batched_tokens=24, use_cuda_graphs=True, async_scheduling=ahead)
    assert sorted(engine.runner.graphs) == [1, 2, 4, 8], "CUDA graph capture failed (see the log)"
    replays = engine.runner.graph_stats.decode_replays
    for trace in (make_trace(n=12), staggered()):  # the second: decode steps of 7, 6, ... 1 sequences
        want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
                for p, n in trace]
        assert min(cuda_routing(ref_gm, p + w)[1] for (p, _), w in zip(trace, want, strict=True)) > MARGIN
        got, lens, _ = run_engine(engine, trace, check=not ahead)
        assert got == want
        assert list(lens.values()) == [cuda_routing(ref_gm, p + w[:-1])[0]
                                       for (p, _), w in zip(trace, want, strict=True)]
    assert engine.runner.graph_stats.decode_replays - replays > 20
    assert (engine.runner.num_routing_ahead > 10) == ahead
    check_no_leaks(engine.block_manager)
