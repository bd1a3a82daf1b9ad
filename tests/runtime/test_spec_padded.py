"""Speculative verification steps in the CUDA-graph shape (b, k + 1), without a GPU.

With pad_decode_batches=True a step whose sequences are all decode chunks of 1 + n tokens (n <= k drafts, some
n > 0) is padded the way a verification graph reads it: k + 1 query rows per sequence (the real tokens last,
padding tokens on the null block before them), padding sequences after the real ones up to a captured batch size,
every row sampled, the real rows first. A draft model's decode steps are padded like the target's. A watch
around each runner's step model poisons the null block (NaN) before every step and checks the step's layout and
where it wrote: the entries that changed are the real rows' slots plus the null block, and every padding token's
slot is in the null block; a real row that read the null block would turn its logits to NaN.

Greedy tokens must equal the unpadded speculative engine's and the plain engine's for the n-gram, self and draft
drafters (batches of 1, 3, 5 of 6 seats: padded to 1, 4, 6; drafts shorter than k), with prefix caching and under
preemption, with no leaked blocks; seeded sampling must give the same tokens padded and unpadded. The same runs
from the graphs' static buffers (StepGraphs.views / fill, as a replay reads them), on the generated kernels
(Triton's interpreter: padding rows with no visible key), and, on a GPU, replayed from captured graphs.
test_spec_padded_churn.py runs the property-based speculative churn on a padded engine.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.ir.frontend import build_graph
from kiln.model_config import param_shapes
from kiln.reference import generate
from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.cuda_graphs import graph_batch_sizes
from kiln.runtime.engine import Engine
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule
from kiln.runtime.speculative import ModelDrafter, NgramDrafter
from kiln.step import KVCache, StepBatch
from tests.support.speculative import other_draft, run_requests, self_draft, spec_models

NAN = float("nan")
SEATS = 6  # max_num_seqs: decode and verification graphs of 1, 2, 4, 6 sequences


def changed(before: torch.Tensor, after: torch.Tensor, bs: int) -> set[tuple[int, int]]:
    """(block, offset) of the pool entries [layers, 2, blocks, block_size, heads, dim] that differ (NaN = NaN)."""
    same = (before == after) | (before.isnan() & after.isnan())
    return {(int(b), int(o)) for b, o in (~same).flatten(4).any(-1).any(1).any(0).nonzero().tolist()}


def verify_pad(runner: ModelRunner, seqs: list) -> int:
    """The batch size a verification step of these chunks must be padded to (0: not one)."""
    q = runner.verify_len
    if not q or not any(s.num_drafts for s in seqs) or len(seqs) > runner.verify_sizes[-1]:
        return 0
    if not all(s.sample and s.num_new == 1 + s.num_drafts <= q for s in seqs):
        return 0
    return min(b for b in runner.verify_sizes if b >= len(seqs))


class Watch:
    """Stands in for a runner's step model: checks each step's padding and where it wrote, records the padded
    verification steps. static=True runs every padded step on the graphs' static buffers (as a replay does)."""

    def __init__(self, runner: ModelRunner, static: bool = False):
        self.runner, self.model, self.bs = runner, runner.model, runner.block_size
        self.graphs = runner.make_graphs() if static else None
        self.sched: Schedule | None = None
        self.padded = 0
        self.verify: list[tuple[int, int, int, int]] = []  # (real sequences, padded, fewest drafts, least context)
        self.static_runs = 0
        prepare = runner.prepare

        def spy(sched, tokens=None, prompt=None):
            self.sched = sched
            batch, self.padded = prepare(sched, tokens, prompt)
            return batch, self.padded

        runner.prepare = spy
        runner.model = self

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, batch: StepBatch, cache: KVCache):
        seqs = self.sched.seqs
        real_rows = self.check_layout(batch, seqs)
        cache.data[:, :, NULL_BLOCK] = NAN
        before = cache.data.clone()
        run = batch
        if self.graphs is not None and self.padded:
            run = self.graphs.views(batch.num_seqs, batch.max_query_len)
            self.graphs.fill(run, batch)
            self.static_runs += 1
        out = self.model(run, cache)
        slots = batch.slot_mapping.tolist()
        real = {divmod(slots[r], self.bs) for r in real_rows}
        assert all(b != NULL_BLOCK for b, _ in real)
        padding = [divmod(x, self.bs) for r, x in enumerate(slots) if r not in real_rows]
        assert all(b == NULL_BLOCK for b, _ in padding), "a padding token writes outside the null block"
        wrote = {x for x in changed(before, cache.data, self.bs) if x[0] != NULL_BLOCK}
        assert wrote <= real, f"written outside the real rows' slots: {sorted(wrote - real)}"
        return out

    def check_layout(self, batch: StepBatch, seqs: list) -> set[int]:
        """The real rows of the batch, after checking a padded verification step's layout."""
        b = verify_pad(self.runner, seqs)
        if not b:
            return set(range(sum(s.num_new for s in seqs)))
        q, nr = self.runner.verify_len, len(seqs)
        assert (batch.num_seqs, batch.max_query_len, batch.num_tokens) == (b, q, b * q)
        assert batch.query_start_loc.tolist() == list(range(0, b * q + 1, q))
        ctx, tok, pos = batch.context_lens.tolist(), batch.tokens.tolist(), batch.positions.tolist()
        rows = []
        for i, s in enumerate(seqs):  # the real tokens end their chunk; the context is the real one
            chunk = list(range((i + 1) * q - s.num_new, (i + 1) * q))
            assert [tok[r] for r in chunk] == s.request.token_slice(s.start, s.start + s.num_new)
            assert [pos[r] for r in chunk] == list(range(s.start, s.start + s.num_new))
            assert ctx[i] == s.start + s.num_new
            rows += chunk
        assert batch.sample_indices.tolist()[: len(rows)] == rows  # the real rows' logits come first
        assert sorted(batch.sample_indices.tolist()) == list(range(b * q))
        assert ctx[nr:] == [1] * (b - nr) and (batch.block_tables[nr:] == NULL_BLOCK).all()
        self.verify.append((nr, b, min(s.num_drafts for s in seqs), min(ctx[:nr])))
        return set(rows)


def watch(engine: Engine, static: bool = False) -> tuple[Watch, Watch | None]:
    runner = getattr(engine.drafter, "runner", None)
    return Watch(engine.runner, static), (Watch(runner, static) if runner is not None else None)


@pytest.fixture(scope="module")
def sm():
    return spec_models()


@pytest.fixture(scope="module")
def trace():
    """14 (prompt, max_tokens): repeated phrases (n-gram drafts accepted), a shared 24-token prefix for a third
    (prefix-cache hits), some 1-3 token prompts (a context shorter than k + 1); then 6 requests admitted together
    whose outputs end one after the other (verification steps of 6, 5, ... 1 sequences)."""
    rng = random.Random(11)
    shared = [rng.randrange(512) for _ in range(24)]
    out = []
    for i in range(14):
        phrase = [rng.randrange(512) for _ in range(rng.randint(1, 8))]
        prompt = phrase * rng.randint(1, 4) if i % 2 else phrase[:3]
        if i % 3 == 0:
            prompt = shared + prompt
        out.append((prompt[:40], rng.randint(3, 14)))
    for i in range(SEATS):
        phrase = [rng.randrange(512) for _ in range(rng.randint(2, 6))]
        out.append((phrase * 3, 4 + 6 * i))
    return out


def drafter(sm, kind: str):
    if kind == "ngram":
        return NgramDrafter(n=2, k=4)
    if kind == "self":
        return ModelDrafter(self_draft(sm, 1), k=3, shares_target_cache=True)
    return ModelDrafter(other_draft(sm, seed=7, layers=1), k=3)


def make(sm, **kw) -> Engine:
    kw = {"num_blocks": 120, "block_size": 4, "max_num_seqs": SEATS, "max_num_batched_tokens": 64, "max_model_len": 64,
          **kw}
    return Engine(sm.target, None, sm.loaded.model, **kw)


def run(engine: Engine, trace, **params) -> list[list[int]]:
    p = {"temperature": 0, "ignore_eos": True, **params}
    return run_requests(engine, [(t, SamplingParams(max_tokens=n, **p)) for t, n in trace])


@pytest.fixture(scope="module")
def plain(sm, trace):
    return run(make(sm), trace)


def check_padding_ran(target: Watch, draft: Watch | None, kind: str) -> None:
    real = {r for r, _, _, _ in target.verify}
    assert {1, 3, 5} <= real, f"real batch sizes padded: {sorted(real)}"
    assert {(3, 4), (5, 6)} <= {(r, b) for r, b, _, _ in target.verify}
    assert min(n for _, _, n, _ in target.verify) < target.runner.verify_len - 1  # drafts shorter than k
    assert target.runner.graph_stats.padded_verifications == len(target.verify)
    if kind != "ngram":  # the draft model's decodes are padded like the target's
        assert draft.runner.pad_sizes == graph_batch_sizes(SEATS) and draft.runner.graph_stats.padded_decodes > 10


@pytest.mark.parametrize("kind", ["ngram", "self", "draft"])
def test_padded_verification_gives_the_unpadded_tokens_with_prefix_caching(sm, trace, plain, kind):
    unpadded = make(sm, drafter=drafter(sm, kind))
    assert run(unpadded, trace) == plain
    assert unpadded.runner.graph_stats.padded_verifications == 0
    engine = make(sm, drafter=drafter(sm, kind), pad_decode_batches=True)
    target, draft = watch(engine)
    assert run(engine, trace) == plain
    st = engine.stats
    assert st.prefix_cache_hits > 0 and st.spec_proposed > st.spec_accepted
    assert st.spec_accepted > 0 or kind == "draft"  # a separate random model's drafts are all rejected
    assert (st.spec_proposed, st.spec_accepted) == (unpadded.stats.spec_proposed, unpadded.stats.spec_accepted)
    check_padding_ran(target, draft, kind)


@pytest.mark.parametrize("kind", ["ngram", "self", "draft"])
def test_padded_verification_under_preemption(sm, trace, plain, kind):
    # 17 usable blocks of 4 tokens (one 64-token sequence needs 16): six requests of up to 52 tokens preempt.
    engine = make(sm, drafter=drafter(sm, kind), pad_decode_batches=True, num_blocks=18)
    target, draft = watch(engine)
    assert run(engine, trace[-SEATS:]) == plain[-SEATS:]
    assert engine.stats.num_preemptions > 0 and engine.stats.spec_proposed > 0
    assert engine.stats.spec_accepted > 0 or kind == "draft"
    assert target.verify and (kind == "ngram" or draft.runner.graph_stats.padded_decodes > 0)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_seeded_sampling_with_speculation_is_the_same_padded_and_unpadded(sm, trace, kind):
    params = {"temperature": 0.9, "top_k": 40, "seed": 5, "speculate": True}  # seeded: speculates only if asked
    staggered = [(p, n // 2) for p, n in trace[-SEATS:]]  # decoding together: verification steps
    want = run(make(sm, drafter=drafter(sm, kind)), staggered, **params)
    engine = make(sm, drafter=drafter(sm, kind), pad_decode_batches=True)
    target, _ = watch(engine)
    assert run(engine, staggered, **params) == want
    assert target.verify and engine.stats.spec_proposed > 0


def test_verification_from_the_graphs_static_buffers(sm, trace, plain):
    """What a replay reads, on CPU: every padded step (decode and verification, target and draft) run from views of
    one set of static buffers, full-width tables with stale columns past the batch's, max_context_len the model's."""
    engine = make(sm, drafter=drafter(sm, "self"), pad_decode_batches=True)
    target, draft = watch(engine, static=True)
    assert run(engine, trace) == plain
    check_padding_ran(target, draft, "self")
    assert target.static_runs > len(target.verify) > 10 and draft.static_runs > 10
    st = target.graphs.static
    q, b = target.runner.verify_len, SEATS
    assert st.tokens.shape[0] == b * q and st.block_tables.shape == (b, target.runner.max_blocks_per_seq)
    assert (st.block_tables != NULL_BLOCK).any()


def test_generated_kernels_serve_padded_verification():
    """The kernel path (Triton's interpreter): the paged prefill kernel over chunks padded to k + 1 rows, including
    a sequence whose context is shorter than k + 1 (its padding rows see no key), against the reference."""
    m = load_model("tiny-llama", device="cpu", seed=0)
    ref = copy.deepcopy(m.gm)
    step = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=True)
    greedy = {"temperature": 0, "ignore_eos": True}
    trace = [([7, 9], 5), ([3, 4, 5, 3, 4, 5, 3, 4], 6), ([11, 12, 13, 14, 15, 11, 12, 13, 14], 5)]
    want = [generate(ref, p, SamplingParams(max_tokens=n, **greedy), context=256).token_ids for p, n in trace]
    engine = Engine(step, None, m.model, block_size=4, max_num_seqs=4, drafter=NgramDrafter(2, 4),
                    pad_decode_batches=True)
    target, _ = watch(engine)
    assert run(engine, trace) == want
    assert engine.stats.spec_accepted > 0 and (3, 4) in {(r, b) for r, b, _, _ in target.verify}
    assert min(c for _, _, _, c in target.verify) < engine.runner.verify_len


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_cuda_graph_verification_matches_the_eager_engine(kind):
    """On CUDA: generated kernels, verification (and decode) steps replayed from captured graphs, the same tokens
    as the eager speculative engine and the reference."""
    m = load_model("tiny-llama", device="cuda", seed=0)
    ref = copy.deepcopy(m.gm)
    weights = {k: v.detach().clone() for k, v in m.gm.state_dict().items()}
    step = compile_step(m.gm, m.model, m.compile, device="cuda", use_kernels=True)

    def drafter_() -> NgramDrafter | ModelDrafter:
        if kind == "ngram":
            return NgramDrafter(n=2, k=4)
        cfg = dataclasses.replace(m.model, layers=1)
        gm = build_graph(cfg, {k: weights[k] for k in param_shapes(cfg)}, dtype=weights["embed.weight"].dtype,
                         device="cuda")
        return ModelDrafter(compile_step(gm, cfg, m.compile, device="cuda", use_kernels=True), k=3,
                            shares_target_cache=True)

    rng = random.Random(2)
    trace = []
    for _ in range(7):
        phrase = [rng.randrange(512) for _ in range(rng.randint(1, 6))]
        trace.append((phrase * rng.randint(1, 4), rng.randint(4, 12)))
    want = [generate(ref, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), context=256).token_ids
            for p, n in trace]
    kw = {"block_size": 16, "max_num_seqs": 8, "num_blocks": 64}
    eager = Engine(step, None, m.model, use_cuda_graphs=False, drafter=drafter_(), **kw)
    graphs = Engine(step, None, m.model, use_cuda_graphs=True, drafter=drafter_(), **kw)
    assert sorted(graphs.runner.graphs) == [1, 2, 4, 8] == sorted(graphs.runner.verify_graphs), "capture failed"
    assert run(eager, trace) == want
    assert run(graphs, trace) == want
    st = graphs.runner.graph_stats
    assert st.verification_replays == st.padded_verifications > 0 and st.decode_replays > 0
    if kind == "self":
        assert sorted(graphs.drafter.runner.graphs) == [1, 2, 4, 8]
        assert graphs.drafter.runner.graph_stats.decode_replays > 0
