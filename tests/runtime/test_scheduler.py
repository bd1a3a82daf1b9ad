"""The scheduler on its own: budgets, chunked prefill, decode-first order, preemption, abort, static batches."""

from __future__ import annotations

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule
from kiln.runtime.scheduler import Scheduler


def req(rid: str, prompt_len: int, order: int, max_tokens: int = 8) -> Request:
    r = Request(rid, None, [order % 7 + 1] * prompt_len, SamplingParams(max_tokens=max_tokens), Detokenizer(None),
                arrival_order=order)
    r.metrics.arrival_time = 0.0  # priority by arrival order alone
    return r


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, policy="continuous", caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy), bm


def apply(sched: Scheduler, s: Schedule) -> None:
    """What the engine does after the model step: advance the cache, append a token, finish at max_tokens."""
    for seq in s.seqs:
        r = seq.request
        r.num_computed_tokens = seq.start + seq.num_new
        sched.bm.commit(r.request_id, r.all_token_ids, r.num_computed_tokens)
        if seq.sample:
            r.output_token_ids.append(5)
            if len(r.output_token_ids) >= r.params.max_tokens:
                sched.finish(r)


def test_chunked_prefill_splits_a_long_prompt_and_samples_once():
    sched, _ = make(budget=32)
    r = req("a", 100, 0)
    sched.add(r)
    chunks = []
    for _ in range(4):
        s = sched.schedule()
        chunks.append([(x.start, x.num_new, x.sample) for x in s.seqs])
        apply(sched, s)
    assert chunks == [[(0, 32, False)], [(32, 32, False)], [(64, 32, False)], [(96, 4, True)]]
    assert sched.schedule().seqs[0].num_new == 1  # then decodes


def test_decodes_are_scheduled_before_prefills_and_budget_is_shared():
    sched, _ = make(budget=10)
    a, b = req("a", 3, 0), req("b", 30, 1)
    sched.add(a)
    apply(sched, sched.schedule())  # a prefilled
    sched.add(b)
    s = sched.schedule()
    assert [(x.request.request_id, x.num_new) for x in s.seqs] == [("a", 1), ("b", 9)]
    assert s.num_tokens == 10


def test_max_num_seqs_caps_running_requests():
    sched, _ = make(max_num_seqs=3, budget=100)
    for i in range(5):
        sched.add(req(str(i), 4, i))
    s = sched.schedule()
    assert len(s.seqs) == 3 and len(sched.running) == 3 and len(sched.waiting) == 2


def test_preemption_picks_the_latest_arrival_and_requeues_it_first():
    sched, bm = make(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks
    reqs = [req(str(i), 8, i, max_tokens=8) for i in range(3)]  # 2 full blocks each
    for r in reqs:
        sched.add(r)
    apply(sched, sched.schedule())
    assert bm.num_free_blocks == 0
    s = sched.schedule()  # every request crosses into a third block: the last arrival is preempted
    assert s.preempted == [reqs[2]] and reqs[2].status is RequestStatus.PREEMPTED
    assert [x.request for x in s.seqs] == reqs[:2]
    assert sched.waiting[0] is reqs[2] and reqs[2].num_computed_tokens == 0
    assert reqs[2].output_token_ids == [5]  # generated tokens are kept: the recompute covers them
    assert sched.num_preemptions == 1
    bm.check_invariants()


def test_a_lone_request_that_cannot_grow_preempts_itself_and_resumes():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)  # 3 usable blocks
    a, b = req("a", 8, 0, max_tokens=4), req("b", 3, 1, max_tokens=4)
    sched.add(a)
    sched.add(b)
    apply(sched, sched.schedule())  # a: 2 blocks, b: 1 block
    s = sched.schedule()  # a needs a third block: b is preempted
    assert s.preempted == [b]
    while sched.has_unfinished():
        apply(sched, sched.schedule())
        bm.check_invariants()
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 4
    assert bm.num_free_blocks == 3


def test_recompute_after_preemption_hits_the_prefix_cache():
    sched, bm = make(num_blocks=7, block_size=4, budget=64)
    reqs = [req("0", 8, 0, max_tokens=2), req("1", 5, 1), req("2", 8, 2)]
    for r in reqs:
        sched.add(r)
    while reqs[2].metrics.num_preemptions == 0:
        apply(sched, sched.schedule())
    while reqs[2].status is not RequestStatus.RUNNING:
        s = sched.schedule()
        apply(sched, s)
    # Request 0 took the victim's tail block; its first block survived in the cache and is reused.
    assert [x.start for x in s.seqs if x.request is reqs[2]] == [4] and bm.stats.prefix_hits >= 1
    # num_cached_tokens is the first admission's (nothing was cached then), as vLLM's: the re-admission adds nothing
    assert reqs[2].metrics.num_cached_tokens == 0


def test_abort_from_waiting_and_running_frees_blocks():
    sched, bm = make(max_num_seqs=1)
    a, b = req("a", 9, 0), req("b", 9, 1)
    sched.add(a)
    sched.add(b)
    apply(sched, sched.schedule())
    sched.finish(b, RequestStatus.ABORTED)  # waiting
    sched.finish(a, RequestStatus.ABORTED)  # running
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def test_static_policy_admits_no_one_until_the_batch_is_done():
    sched, _ = make(max_num_seqs=2, budget=100, policy="static")
    rs = [req(str(i), 4, i, max_tokens=2 + 3 * (i == 0)) for i in range(3)]
    for r in rs:
        sched.add(r)
    seen = []
    while sched.has_unfinished():
        s = sched.schedule()
        seen.append({x.request.request_id for x in s.seqs})
        apply(sched, s)
    # r1 finishes after 2 tokens, but r2 only starts once r0 (5 tokens) is done too.
    assert seen[:5] == [{"0", "1"}, {"0", "1"}, {"0"}, {"0"}, {"0"}] and seen[5] == {"2"}
