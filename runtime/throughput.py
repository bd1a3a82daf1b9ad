"""Offline throughput: replay a seeded synthetic trace through an engine and measure it.

Every request of the trace arrives at once (an offline batch, as in vLLM's throughput benchmark); outputs
have exactly their sampled length (greedy, ignore_eos). The same trace runs with continuous batching and with
the static baseline (kiln.runtime.scheduler's "static" policy: a batch of up to max_num_seqs requests is
admitted only when the previous batch has completely finished) on the same step model, in the same process.
Finished members leave a static batch instead of decoding padding, so the baseline is if anything flattered.
Before either timed run a short untimed batch (warm_up) goes through a throwaway engine over the same step model,
so that one-time start-up costs (first kernel launches and dispatch, allocator growth) fall on neither policy;
otherwise the continuous run, always first, would absorb them and bias the ratio.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class TraceRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """"100:1024" -> (100, 1024); "64" -> (64, 64)."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        # A ValueError, as int() raises for "x:3": the callers (`kiln bench throughput`, `kiln bench serve`) turn
        # either into a user error naming --input-len / --output-len
        raise ValueError(f"{text!r}: expected LO:HI with 1 <= LO <= HI")
    return a, b


def make_trace(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], *, vocab: int,
               context: int, seed: int = 0) -> tuple[list[TraceRequest], int]:
    """Seeded requests with uniform lengths; pairs longer than the context are shortened (returns how many)."""
    rng = random.Random(seed)
    trace, clipped = [], 0
    for _ in range(num_requests):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        if n_in + n_out > context:
            clipped += 1
            n_out = max(1, min(n_out, context // 2))
            n_in = min(n_in, context - n_out)
        trace.append(TraceRequest([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return trace, clipped


WARMUP = {"requests": 4, "prompt_len": 16, "output_len": 4}  # the untimed warm-up batch: short, a few rows


def warm_up(engine: Engine, *, vocab: int, context: int, requests: int = WARMUP["requests"],
            prompt_len: int = WARMUP["prompt_len"], output_len: int = WARMUP["output_len"]) -> dict:
    """Run a short batch of random requests to completion, untimed; what ran (for the result JSON).

    Its prompts come from their own seeded generator, not the trace's, and the caller gives it its own engine, so
    the timed runs see no prefix-cache hits or counters from it."""
    output_len = max(1, min(output_len, context // 2))
    prompt_len = max(1, min(prompt_len, context - output_len))
    rng = random.Random("kiln-throughput-warm-up")
    start = time.perf_counter()
    for i in range(requests):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
        engine.add_request(prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)], params=params,
                           request_id=f"warm-up-{i}")
    while engine.has_unfinished():
        engine.step()
    return {"requests": requests, "prompt_len": prompt_len, "output_len": output_len,
            "elapsed_s": time.perf_counter() - start}


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(xs)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    return {"mean": sum(s) / len(s), "p50": pct(0.5), "p99": pct(0.99)}


def run_trace(engine: Engine, trace: list[TraceRequest], *, label: str = "",
              progress: Callable[[str], None] | None = None, progress_every_s: float = 5.0) -> dict:
    """Run every request to completion; throughput, TTFT and TPOT (seconds) over the whole trace."""
    start = time.perf_counter()
    for i, r in enumerate(trace):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True, output_kind="final_only")
        engine.add_request(prompt_token_ids=r.prompt_token_ids, params=params, request_id=f"{label}{i}")
    finished = []
    last = start
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
        now = time.perf_counter()
        if progress is not None and now - last >= progress_every_s:
            progress(f"{label.rstrip('-') or 'bench'}: {len(finished)}/{len(trace)} requests done, {now - start:.1f} s")
            last = now
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    ttft = [o.metrics.first_token_time - start for o in finished if o.metrics.first_token_time is not None]
    tpot = [t for o in finished if (t := o.metrics.tpot_s(len(o.outputs[0].token_ids))) is not None]
    st = engine.stats
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(finished) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + sum(len(r.prompt_token_ids) for r in trace)) / elapsed,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(tpot),
        "steps": st.num_steps,
        "preemptions": st.num_preemptions,
        "prefix_cache_hits": st.prefix_cache_hits,
        "batched_tokens": st.num_batched_tokens,
        **({"speculation": {"proposed": st.spec_proposed, "accepted": st.spec_accepted,
                            "acceptance_rate": st.acceptance_rate, "mean_accepted_length": st.mean_accepted_length,
                            "verify_steps": st.spec_verify_steps, "off_steps": st.spec_off_steps}}
           if engine.drafter is not None else {}),
    }


def format_report(result: dict) -> str:
    """The human-readable table of a throughput result (the JSON has everything)."""
    lines = [f"{'':12}{'req/s':>9}{'out tok/s':>11}{'TTFT mean':>11}{'p50':>9}{'p99':>9}"
             f"{'TPOT mean':>11}{'p50':>9}{'p99':>9}"]
    for name in ("continuous", "static"):
        r = result[name]
        t, p = r["ttft_s"], r["tpot_s"]
        lines.append(f"{name:12}{r['requests_per_s']:9.2f}{r['output_tokens_per_s']:11.1f}"
                     f"{t['mean'] * 1e3:9.0f}ms{t['p50'] * 1e3:7.0f}ms{t['p99'] * 1e3:7.0f}ms"
                     f"{p['mean'] * 1e3:9.1f}ms{p['p50'] * 1e3:7.1f}ms{p['p99'] * 1e3:7.1f}ms")
    ttft = result["speedup"]["ttft_mean"]  # static's mean TTFT / continuous's
    ttft_words = f"{ttft:.2f}x lower mean TTFT" if ttft >= 1 or ttft <= 0 else f"{1 / ttft:.2f}x higher mean TTFT"
    lines.append(f"continuous / static: {result['speedup']['output_tokens_per_s']:.2f}x output tokens/s, "
                 f"{ttft_words}")
    if "warmup" in result:
        w = result["warmup"]
        lines.append(f"(after an untimed warm-up of {w['requests']} requests, {w['prompt_len']} prompt + "
                     f"{w['output_len']} output tokens each, {w['elapsed_s']:.2f} s)")
    return "\n".join(lines)
