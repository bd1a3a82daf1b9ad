"""Forward latency of a 1B-class HF Llama under torch.compile: backend="kiln" vs eager vs inductor, in one run.

The model is LlamaForCausalLM with Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 kv heads,
head_dim 64, ffn 8192, vocab 128256), random weights, bf16, sdpa attention. Two workloads, batch 1:
  prefill  one forward over --prefill tokens (default 2048), no cache
  decode   one forward of 1 token after a --prefill-token DynamicCache (a fresh copy of the cache per call, made
           outside the timed region, so every call sees the same shapes)
Each variant is warmed up (compiles happen there) and then timed with CUDA events; reported: mean and median
ms, and the speed-up over eager measured in the same run. Results go to bench/results/torch_backend-<time>.json
with device, versions and the git commit.

Needs CUDA: without it this says so and exits 2, with no figures.

    python bench/torch_backend.py [--prefill 2048] [--iters 20] [--variants eager,inductor,kiln]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip


def build_model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**LLAMA_1B)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def time_calls(fn, setup, iters: int, warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn(setup()) (setup outside the timed region)."""
    for _ in range(warmup):
        fn(setup())
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        arg = setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default="eager,inductor,kiln")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/torch_backend.py needs a CUDA device; none is available, so there are no figures.", file=sys.stderr
        )
        return 2
    import transformers
    import triton
    from transformers import DynamicCache

    model = build_model()
    tokens = torch.randint(3, LLAMA_1B["vocab_size"], (1, args.prefill), device="cuda")
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(tokens, past_key_values=cache, use_cache=True)
    step = torch.randint(3, LLAMA_1B["vocab_size"], (1, 1), device="cuda")
    results: dict[str, dict] = {}
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        fwd = model.forward if variant == "eager" else torch.compile(model.forward, backend=variant)
        workloads = {
            "prefill": (lambda _, f=fwd: f(tokens, use_cache=False), lambda: None),
            "decode": (lambda c, f=fwd: f(step, past_key_values=c, use_cache=True), lambda: copy.deepcopy(cache)),
        }
        results[variant] = {}
        for name, (fn, setup) in workloads.items():
            with torch.no_grad():
                ms = time_calls(fn, setup, args.iters)
            results[variant][name] = {"mean_ms": statistics.mean(ms), "median_ms": statistics.median(ms)}
            print(f"{variant:>9} {name:>8}: {statistics.median(ms):8.3f} ms (median of {args.iters})")
    for rows in results.values():
        for name, row in rows.items():
            if "eager" in results:
                row["speedup_vs_eager"] = results["eager"][name]["median_ms"] / row["median_ms"]
    out = {
        "bench": "torch_backend", "model": "llama-3.2-1b shape, random weights, bf16, sdpa", "batch": 1,
        "prefill_tokens": args.prefill, "iters": args.iters, "results": results,
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
        "commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"torch_backend-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
