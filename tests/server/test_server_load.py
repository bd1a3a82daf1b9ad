"""64 concurrent streaming clients against one server: batched together, token-exact, and disconnects abort."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from tests.support.served_llm import serve_llm

httpx = pytest.importorskip("httpx")

N = 64
PROMPTS = [f"request {i}: " + "abcdefgh"[: i % 8] for i in range(N)]
SHORT, LONG = 6, 16  # max_tokens of the plain run, and of the run with disconnects


@pytest.fixture(scope="module")
def served():
    from kiln import LLM, SamplingParams

    llm = LLM("tiny-llama", device="cpu", seed=0, use_kernels=False, max_num_seqs=N)
    # The references, from the offline API, before the server's loop takes the engine over (greedy: the
    # SHORT-token answers are the prefixes of the LONG ones).
    long = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=LONG, ignore_eos=True))]
    ref = {LONG: long, SHORT: [t[:SHORT] for t in long]}
    with serve_llm(llm, engine=llm.engine) as url:
        yield url, ref, llm.engine


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^(kiln_\w+)\{model_name="tiny-llama"\} (\S+)$', text, re.M)}


async def stream_one(client, url: str, i: int, max_tokens: int, stop_after: int | None = None) -> list[int]:
    body = {"model": "tiny-llama", "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    ids: list[int] = []
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return ids  # leaving the block closes the connection mid-stream
    return ids


async def run_clients(url: str, max_tokens: int, drop: set[int]) -> list[list[int]]:
    limits = httpx.Limits(max_connections=N + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, url, i, max_tokens, 2 if i in drop else None)
                                      for i in range(N)))


def wait_idle(url: str, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        if m["kiln_num_requests_running"] == 0 and m["kiln_num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_64_streaming_clients_get_the_offline_tokens_batched_together(served):
    url, ref, _ = served
    before = metrics(url)
    got = asyncio.run(run_clients(url, SHORT, set()))
    assert got == ref[SHORT]
    m = wait_idle(url)
    assert m["kiln_max_running_requests_per_step"] > 1  # served as one batch, not one by one
    assert m["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"] == N * SHORT
    steps = m["kiln_engine_steps_total"] - before["kiln_engine_steps_total"]
    assert steps < N * SHORT / 4, f"{steps} steps for {N} requests of {SHORT} tokens: barely batched"
    assert m["kiln_kv_blocks_used"] == 0


def test_disconnecting_clients_abort_and_free_their_blocks(served):
    url, ref, engine = served
    drop = set(range(3, N, 6)[:10])
    before = metrics(url)
    got = asyncio.run(run_clients(url, LONG, drop))
    for i in range(N):
        if i in drop:
            assert len(got[i]) < LONG and got[i] == ref[LONG][i][: len(got[i])]
        else:
            assert got[i] == ref[LONG][i], f"client {i} got different tokens after others disconnected"
    m = wait_idle(url)
    assert m["kiln_requests_aborted_total"] - before["kiln_requests_aborted_total"] == len(drop)
    assert m["kiln_kv_blocks_used"] == 0  # no leak: every block is back in the free pool
    engine.block_manager.check_invariants()
    assert not engine.block_manager.tables
