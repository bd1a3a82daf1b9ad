"""`kiln bench serve`: replay a seeded trace against a running server, as vLLM's serving benchmark does.

Requests go to /v1/completions as token-id prompts (greedy, ignore_eos, exactly output_len tokens), streamed,
either arriving as a seeded Poisson process at --request-rate or kept at --max-concurrency in flight. Per
request: TTFT (send to first token), inter-token latencies (between streamed chunks) and TPOT ((end - first
token) / (tokens - 1)); overall: request and token throughput over the wall time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.runtime.throughput import TraceRequest, _stats


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client, url: str, model: str, r: TraceRequest, headers: dict) -> Result:
    body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}  # one chunk per token, even when its text is held back (partial UTF-8)
    res = Result(ok=False, prompt_len=len(r.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"{resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                k = max(len(chunk["choices"][0].get("token_ids") or ()), 1)
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:  # a chunk of k tokens: k gaps of equal share
                    res.itl += [(now - last) / k] * k
                last = now
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.ok = True
    return res


async def run_serving_bench(base_url: str, trace: list[TraceRequest], *, model: str, request_rate: float,
                            max_concurrency: int | None, seed: int, api_key: str | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    limit = max_concurrency or len(trace)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 8)) as client:
        async def gated(r: TraceRequest) -> Result:
            async with sem:
                return await _one(client, url, model, r, headers)

        tasks = []
        start = time.perf_counter()
        for r in trace:
            tasks.append(asyncio.create_task(gated(r)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return summarize(results, elapsed)


def summarize(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    if not ok:
        raise KilnError(f"all {len(results)} benchmark requests failed; first error: {results[0].error}")
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ms = lambda d: {k: v * 1e3 for k, v in d.items()}  # noqa: E731
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": elapsed,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed, "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / elapsed,
        "ttft_ms": ms(_stats([r.ttft for r in ok])), "tpot_ms": ms(_stats(tpot)),
        "itl_ms": ms(_stats([x for r in ok for x in r.itl])),
        "e2el_ms": ms(_stats([r.latency for r in ok])),
    }


def format_serving_report(res: dict) -> str:
    lines = [f"requests: {res['completed']} completed, {res['failed']} failed in {res['duration_s']:.2f} s",
             f"throughput: {res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} output tok/s, "
             f"{res['total_token_throughput']:.1f} total tok/s",
             f"{'':8}{'mean':>10}{'p50':>10}{'p99':>10}  (ms)"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = res[f"{name}_ms"]
        lines.append(f"{name.upper():8}{s['mean']:10.2f}{s['p50']:10.2f}{s['p99']:10.2f}")
    return "\n".join(lines)
