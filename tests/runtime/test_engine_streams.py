"""Outputs are routed per request: any number of generate_stream generators and generate calls interleave in
one LLM (one thread or several) with nothing lost or stalled, and each stream's deltas add up to its final
output."""

from __future__ import annotations

import threading

import pytest

from kiln.errors import KilnError
from kiln.runtime.sampling_params import SamplingParams

PROMPTS = ["Hello", "Once upon a time", "x", "The quick brown"]
LENGTHS = [5, 9, 3, 7]


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt's final output run alone: what every interleaving must reproduce."""
    return {p: llm.generate(p, greedy(n))[0].outputs[0] for p, n in zip(PROMPTS, LENGTHS, strict=True)}


def run_with_timeout(fn, timeout: float = 240.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not finish in time."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s: a stream stalled"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def check_stream(outs, want) -> None:
    """The deltas of one request's outputs concatenate to its final text and tokens, which equal `want`."""
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text == want.text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids == want.token_ids


def test_four_interleaved_streams_with_a_generate_in_between(llm, solo):
    def body():
        streams = [llm.generate_stream(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
        got: list[list] = [[] for _ in streams]
        live = set(range(len(streams)))
        rounds = 0
        while live:
            for i in sorted(live):
                try:
                    got[i].append(next(streams[i]))
                except StopIteration:
                    live.discard(i)
            rounds += 1
            if rounds == 2:  # a blocking generate while all four streams are open and partly read
                (mid,) = llm.generate(PROMPTS[1], greedy(LENGTHS[1]))
                assert mid.outputs[0].token_ids == solo[PROMPTS[1]].token_ids
        return got

    got = run_with_timeout(body)
    for outs, p in zip(got, PROMPTS, strict=True):
        check_stream(outs, solo[p])
    assert not llm.engine.has_unfinished() and not llm._queues


def test_a_stream_left_unread_keeps_its_deltas_until_read(llm, solo):
    def body():
        idle = llm.generate_stream(PROMPTS[0], greedy(LENGTHS[0]))
        first = next(idle)  # started, then left alone while others run to the end
        others = llm.generate(PROMPTS[2:], [greedy(n) for n in LENGTHS[2:]])
        busy = list(llm.generate_stream(PROMPTS[1], greedy(LENGTHS[1])))
        return [first, *idle], others, busy

    idle, others, busy = run_with_timeout(body)
    check_stream(idle, solo[PROMPTS[0]])
    check_stream(busy, solo[PROMPTS[1]])
    assert [o.outputs[0].token_ids for o in others] == [solo[p].token_ids for p in PROMPTS[2:]]


def test_streams_and_generate_from_several_threads(llm, solo):
    results: dict[str, object] = {}

    def consume(i: int) -> None:
        results[PROMPTS[i]] = list(llm.generate_stream(PROMPTS[i], greedy(LENGTHS[i])))

    def blocking() -> None:
        results["generate"] = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])

    def body():
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        threads.append(threading.Thread(target=blocking))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run_with_timeout(body)
    for p in PROMPTS:
        check_stream(results[p], solo[p])
    assert [o.outputs[0].token_ids for o in results["generate"]] == [solo[p].token_ids for p in PROMPTS]


def test_closing_a_stream_early_aborts_only_its_requests(llm, solo):
    def body():
        a = llm.generate_stream(PROMPTS[0], greedy(LENGTHS[0]))
        b = llm.generate_stream(PROMPTS[1], greedy(LENGTHS[1]))
        got_b = [next(b)]
        next(a)
        a.close()
        got_b += list(b)
        return got_b

    check_stream(run_with_timeout(body), solo[PROMPTS[1]])
    assert not llm.engine.has_unfinished() and not llm._queues


def test_generate_aborts_what_it_added_when_it_raises(llm, solo, monkeypatch):
    calls = {"n": 0}
    real_step = llm.engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KilnError("injected step failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KilnError, match="injected"):
        llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
    assert not llm.engine.has_unfinished() and not llm._queues
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    monkeypatch.undo()
    # The LLM is still usable, with the same results.
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
    assert [o.outputs[0].token_ids for o in outs] == [solo[p].token_ids for p in PROMPTS]
