"""KV cache benchmark: generating with the paged KV cache (the engine, one request) vs without (the reference
path, which recomputes the whole sequence for every token), on the same model in the same run.

    python bench/kv_cache.py [--spec tiny-llama] [--tokens 200] [--prompt-len 16] [--device auto]

Prints tokens/s of both and their ratio, checks both generated the same greedy tokens, and writes
bench/results/kv_cache-<device>-<date>.json (--out-dir to change where; metadata from bench_meta.py).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

from bench_meta import result_path, run_metadata, write_json

from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.reference import generate
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def run(spec: str, tokens: int, prompt_len: int, device: str, seed: int = 0) -> dict:
    m = load_model(spec, device=device, seed=seed)
    if prompt_len + tokens > m.model.context:
        raise SystemExit(f"prompt {prompt_len} + {tokens} tokens exceeds {m.model.name}'s context {m.model.context}")
    rng = random.Random(seed)
    prompt = [rng.randrange(m.model.vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ref_gm = copy.deepcopy(m.gm)  # compile_step rewrites its graph in place
    step = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=m.device.type == "cuda")
    # No prefix caching: the warm-up runs the same prompt, and the timed run must compute it as the uncached one does
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=1, enable_prefix_caching=False)

    hits = []

    def cached() -> list[int]:
        engine.add_request(prompt_token_ids=prompt, params=params)
        out = engine.run()[0]
        hits.append(out.metrics.num_cached_tokens)  # 0: the prompt is computed, as in the uncached run
        return out.outputs[0].token_ids

    def uncached() -> list[int]:
        return generate(ref_gm, prompt, params, context=m.model.context).token_ids

    cached()  # warm-up (first-call allocations, kernel loading)
    result = {"model": m.model.name, **run_metadata(), "prompt_len": prompt_len, "tokens": tokens}
    for name, fn in (("cached", cached), ("uncached", uncached)):
        if m.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if m.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        result[name] = {"seconds": elapsed, "tokens_per_s": len(out) / elapsed, "token_ids": out}
    result["cached"]["prompt_tokens_from_prefix_cache"] = hits[-1]
    result["ratio"] = result["cached"]["tokens_per_s"] / result["uncached"]["tokens_per_s"]
    result["same_tokens"] = result["cached"]["token_ids"] == result["uncached"]["token_ids"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="tiny-llama")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    r = run(args.spec, args.tokens, args.prompt_len, args.device)
    print(f"{r['model']} on {r['device']}: {r['tokens']} tokens after a {r['prompt_len']}-token prompt\n"
          f"  cached (engine, paged KV):     {r['cached']['tokens_per_s']:9.1f} tokens/s\n"
          f"  uncached (reference.generate): {r['uncached']['tokens_per_s']:9.1f} tokens/s\n"
          f"  ratio {r['ratio']:.2f}x; same greedy tokens: {r['same_tokens']}")
    path = write_json(result_path(args.out_dir, f"kv_cache-{args.spec}"), r)
    print(f"wrote {path}", file=sys.stderr)
    return 0 if r["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
