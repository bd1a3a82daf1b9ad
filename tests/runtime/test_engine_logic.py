"""Engine behaviour on a fake step model (tests/support/fake_step.py): no leaks under any mix of add / step / abort /
preemption (the state machines of tests/support/engine_machines.py), the KV waste bound, request validation, stop
conditions, streaming, padding, start-up errors."""

from __future__ import annotations

import random

import pytest

from kiln.errors import KilnError, RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_machines import (
    EngineMachine,
    SpeculativeMachine,
    SpeculativeOwnPoolMachine,
    SpeculativeSharedMachine,
    V,
    engine,
    greedy,
    speculative_engine,
)
from tests.support.fake_step import fake_generate

test_no_leak_under_random_add_step_abort = EngineMachine.TestCase
test_no_leak_with_ngram_speculation = SpeculativeMachine.TestCase
test_no_leak_with_a_draft_model = SpeculativeOwnPoolMachine.TestCase
test_no_leak_with_a_self_drafter = SpeculativeSharedMachine.TestCase


def test_mixed_requests_with_chunking_and_preemption_match_the_oracle():
    e = engine(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=16)
    rng = random.Random(0)
    reqs = [([rng.randrange(V) for _ in range(rng.randint(1, 40))], rng.randint(1, 20)) for _ in range(30)]
    ids = [e.add_request(prompt_token_ids=p, params=greedy(n)) for p, n in reqs]
    done = {o.request_id: o.outputs[0] for o in e.run()}
    assert [done[i].token_ids for i in ids] == [fake_generate(p, n, V) for p, n in reqs]
    assert all(done[i].finish_reason == "length" for i in ids)
    assert e.stats.num_preemptions > 0


def test_decode_batches_padded_to_graph_sizes():
    e = engine(max_num_seqs=8, pad_decode_batches=True)
    for i in range(5):
        e.add_request(prompt_token_ids=[i + 1] * 3, params=greedy(4))
    outs = {o.request_id: o.outputs[0].token_ids for o in e.run()}
    assert all(outs[str(i)] == fake_generate([i + 1] * 3, 4, V) for i in range(5))
    assert set(e.model.batch_sizes[1:]) <= {1, 2, 4, 8} and 8 in e.model.batch_sizes  # 5 decodes -> 8 rows


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(top_k=-2), "top_k"),  # -1 is vLLM's "off"
        ([1, 2], SamplingParams(stop=("",)), "stop"),
        ([1] * 64, SamplingParams(max_tokens=10), "prompt"),  # fills context 64: no room for one token
        ([1] * 60, SamplingParams(max_tokens=10, min_tokens=5), "min_tokens"),  # 65 > context 64
        ([], SamplingParams(), "prompt"),
        ([1, V], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_requests_are_refused_and_the_others_still_finish(prompt, params, needle):
    e = engine()
    good = e.add_request(prompt_token_ids=[5, 6, 7], params=greedy(5))
    with pytest.raises(RequestError) as err:
        e.add_request(prompt_token_ids=prompt, params=params)
    assert needle in str(err.value)
    also = e.add_request(prompt_token_ids=[8], params=greedy(3))
    done = {o.request_id: o.outputs[0].token_ids for o in e.run()}
    assert done == {good: fake_generate([5, 6, 7], 5, V), also: fake_generate([8], 3, V)}


def test_duplicate_request_id_is_refused_and_generated_ids_avoid_taken_ones():
    e = engine()
    e.add_request(prompt_token_ids=[1], params=greedy(2), request_id="x")
    with pytest.raises(RequestError, match="request_id"):
        e.add_request(prompt_token_ids=[1], params=greedy(2), request_id="x")
    e.add_request(prompt_token_ids=[1], params=greedy(2), request_id="4")
    assert {e.add_request(prompt_token_ids=[1], params=greedy(2)) for _ in range(3)} == {"3", "5", "6"}
    with pytest.raises(RequestError, match="prompt_token_ids"):
        e.add_request(prompt_token_ids=[1.5], params=greedy(2))


def test_pool_too_small_for_one_context_is_refused_at_start_up():
    with pytest.raises(KilnError) as err:
        engine(num_blocks=10, context=64)  # 9 usable blocks of 4; a 64-token sequence needs 16
    msg = str(err.value)
    assert "10 blocks" in msg and "needs 16 blocks" in msg and "raise num_blocks to at least 17" in msg


def test_stop_token_eos_and_ignore_eos():
    prompt = [3, 1, 4]
    full = fake_generate(prompt, 12, V)
    stop_tok = full[5]
    e = engine()
    a = e.add_request(prompt_token_ids=prompt, params=greedy(12, stop_token_ids=(stop_tok,)))
    done = {o.request_id: o.outputs[0] for o in e.run()}
    assert done[a].token_ids == full[: full.index(stop_tok) + 1]
    assert done[a].finish_reason == "stop" and done[a].stop_reason == stop_tok
    tok = ByteTokenizer(V, eos_token_ids=(stop_tok,))
    e = engine(tokenizer=tok)
    a = e.add_request(prompt_token_ids=prompt, params=greedy(12))
    b = e.add_request(prompt_token_ids=prompt, params=greedy(12, ignore_eos=True))
    done = {o.request_id: o.outputs[0] for o in e.run()}
    assert done[a].finish_reason == "stop" and done[a].token_ids[-1] == stop_tok
    assert done[b].finish_reason == "length" and done[b].token_ids == full


def test_stop_string_trims_the_text_and_ends_the_request():
    tok = ByteTokenizer(128)
    prompt = [72, 105, 33]
    full = fake_generate(prompt, 20, 128)
    text = tok.decode(full)
    stop = text[6:8]
    cut = text.index(stop)
    e = engine(vocab=128, tokenizer=tok)
    rid = e.add_request(prompt_token_ids=prompt, params=greedy(20, stop=stop))
    streamed = ""
    final = None
    for out in e.stream():
        streamed += out.outputs[0].delta_text
        final = out.outputs[0]
        assert stop not in streamed  # held back text is never sent and then taken back
    assert final.text == streamed == text[:cut] and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.token_ids == full[: cut + len(stop)]  # up to the token that completed the stop string
    assert rid == "0"


def test_streaming_deltas_add_up_to_the_final_output():
    tok = ByteTokenizer(128)
    e = engine(vocab=128, tokenizer=tok)
    ids = [e.add_request(prompt_token_ids=[i + 40] * (i + 1), params=greedy(10)) for i in range(3)]
    toks = {i: [] for i in ids}
    texts = dict.fromkeys(ids, "")
    finals = {}
    for out in e.stream():
        toks[out.request_id] += out.outputs[0].delta_token_ids
        texts[out.request_id] += out.outputs[0].delta_text
        if out.finished:
            finals[out.request_id] = out.outputs[0]
    for rid in ids:
        assert toks[rid] == finals[rid].token_ids and texts[rid] == finals[rid].text
        assert finals[rid].text == tok.decode(finals[rid].token_ids)


def test_abort_returns_a_final_output_and_frees_blocks():
    e = engine()
    a = e.add_request(prompt_token_ids=[1, 2, 3], params=greedy(30))
    b = e.add_request(prompt_token_ids=[4, 5], params=greedy(30))
    e.step()
    e.step()
    assert e.abort(a) and not e.abort(a) and not e.abort("nope")
    outs = e.step()
    gone = [o for o in outs if o.request_id == a]
    assert gone and gone[0].finished and gone[0].outputs[0].finish_reason == "abort"
    assert len(gone[0].outputs[0].token_ids) == 2
    e.abort(b)
    e.step()
    assert not e.has_unfinished() and e.block_manager.num_free_blocks == e.block_manager.num_usable_blocks


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
    alone = engine()
    alone.add_request(prompt_token_ids=[9, 9], params=params)
    want = alone.run()[0].outputs[0].token_ids
    crowd = engine()
    for i in range(6):
        crowd.add_request(prompt_token_ids=[i, 1], params=SamplingParams(temperature=1.0, max_tokens=5, seed=i))
    rid = crowd.add_request(prompt_token_ids=[9, 9], params=params)
    got = {o.request_id: o.outputs[0].token_ids for o in crowd.run()}[rid]
    assert got == want and got != fake_generate([9, 9], 12, V)  # sampled, not greedy


@pytest.mark.parametrize("kind", ["ngram", "own", "shared"])
def test_speculation_on_the_fake_model_matches_the_oracle_and_rolls_back(kind):
    """Fixed requests (the churn machines above are random): drafts are proposed (and, from the draft model,
    accepted and rejected), greedy outputs equal the oracle, every block comes back."""
    eng = speculative_engine(kind)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [0, 1, 0, 1, 0, 1, 0], [3] * 9, [2, 0, 2, 1, 2, 0, 2]]
    ids = [eng.add_request(prompt_token_ids=p, params=greedy(12)) for p in prompts]
    done = {o.request_id: o.outputs[0].token_ids for o in eng.run()}
    assert [done[i] for i in ids] == [fake_generate(p, 12, V) for p in prompts]
    st = eng.stats
    assert st.spec_proposed > 0 and st.spec_rows > 0 and st.spec_drafter_failures == 0
    if kind != "ngram":
        assert 0 < st.spec_accepted < st.spec_proposed
        assert st.num_steps < 12 + 2  # accepted drafts saved steps
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.tables
