"""Forward latency of a 1B-class HF Llama under torch.compile: backend="kiln" against eager and inductor, in one run.

The model is LlamaForCausalLM with Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 kv heads,
head_dim 64, ffn 8192, vocab 128256), random weights, bf16, sdpa attention, batch 1. Two workloads:
  prefill  one forward over --prefill tokens (default 2048), no cache
  decode   one forward of 1 token at position --prefill of a StaticCache filled by an eager prefill (its fill
           level reset before every call, outside the timed region, so every call writes the same slot and sees
           the same shapes; static cache tensors are what CUDA graphs need)
Variants (--variants, comma-separated):
  eager        model.forward
  inductor     torch.compile(model.forward)                     inductor-ro  ... mode="reduce-overhead"
  kiln         torch.compile(..., backend="kiln")               kiln-ro      ... mode="reduce-overhead"
  kiln-eager   backend="kiln" with options={"fallback": "eager"} (the unclaimed part run eagerly)
Each variant is checked against eager's logits on the same inputs (max abs difference, relative to eager's largest
logit), warmed up (compiles and CUDA graph recording happen there), then timed: median and mean of --iters calls
with CUDA events. Ratios are against eager and inductor measured in the same run. --explain adds, for kiln, the
per-region and rest timing of kiln.explain(timing=True) (its text goes into the JSON). The JSON is written
once the variants are timed and again after --explain; a variant (or --explain) that raises is recorded under
"errors" and the rest still run; any error or mismatch makes the exit code 1.

Needs CUDA for figures: without it this says so and exits 2. --smoke runs a tiny Llama on whatever device there is
(fp32 on CPU, kernels in Triton's interpreter when TRITON_INTERPRET=1), checks every variant against eager and
writes no figures (--save-smoke writes its JSON too): what tests/bench/test_bench_torch_backend.py runs so that
the GPU run finds no typo.

    python bench/torch_backend.py [--prefill 2048] [--iters 20] [--variants ...] [--explain] [--out-dir DIR]
                                  [--kiln-options '{"claims": {"attention": false}}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kiln.dynamo.timing import times_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import result_path, run_metadata, write_json  # noqa: E402  (the bench/ folder is not a package)

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "inductor", "inductor-ro", "kiln", "kiln-ro", "kiln-eager")
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
# Largest |logits - eager| / max |eager| accepted: bf16 kernels accumulate in another order than cuBLAS / sdpa.
TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-3}


def build_model(shape: dict, device: str, dtype: torch.dtype):
    import transformers as tf  # the test extra; only the benchmark itself needs it

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**shape), attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def compiled_forward(model, variant: str, kiln_options: dict | None = None):
    torch._dynamo.reset()
    f = model.forward
    if variant == "eager":
        return f
    mode = "reduce-overhead" if variant.endswith("-ro") else None
    if not variant.startswith("kiln"):
        return torch.compile(f, mode=mode)
    if variant == "kiln-eager":
        return torch.compile(f, backend="kiln", options={**(kiln_options or {}), "fallback": "eager"})
    if kiln_options:  # torch.compile takes mode= or options=, not both: kiln reads its mode from options too
        return torch.compile(f, backend="kiln", options={**kiln_options, **({"mode": mode} if mode else {})})
    return torch.compile(f, backend="kiln", mode=mode)


def time_ms(fn, setup, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Milliseconds per call of fn() after `warmup` untimed calls; setup() runs before each, untimed."""
    return times_ms(fn, iters, cuda, warmup, setup)


def workloads(model, prefill: int, device: str):
    """name -> (call(forward) -> logits, setup() before each call, the eager logits)."""
    from transformers import StaticCache  # as in build_model

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (1, prefill), generator=g).to(device)
    step = torch.randint(3, vocab, (1, 1), generator=g).to(device)
    cache = StaticCache(config=model.config, max_cache_len=prefill + 8)
    with torch.no_grad():
        model(tokens, past_key_values=cache, use_cache=True)
    pos = torch.tensor([prefill], device=device)

    def run_prefill(f):
        return f(tokens, use_cache=False).logits

    def rewind():  # every decode call advances the cache's fill level (transformers 5.2x): back to the prompt's end
        for layer in cache.layers:
            filled = getattr(layer, "cumulative_length", None)  # versions writing at cache_position have none
            if isinstance(filled, torch.Tensor):
                filled.fill_(prefill)
            elif isinstance(filled, int):
                layer.cumulative_length = prefill

    def run_decode(f):
        return f(step, past_key_values=cache, cache_position=pos, use_cache=True).logits

    with torch.no_grad():
        rewind()
        want = run_decode(model.forward)
        prefilled = run_prefill(model.forward)
    return {"prefill": (run_prefill, lambda: None, prefilled), "decode": (run_decode, rewind, want)}


def explain_text(model, prefill: int, device: str, iters: int, baselines: str, options: dict | None) -> str:
    """kiln.explain(timing=True) of the prefill forward (HF's default DynamicCache: the cache writes are in it)."""
    import kiln  # only for --explain: the other variants reach kiln through torch.compile's entry point

    tokens = torch.randint(3, model.config.vocab_size, (1, prefill), device=device)
    report = kiln.explain(model, tokens, timing=True, iters=iters, baselines=baselines.split(","), **(options or {}))
    return str(report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens (default 2048; 12 with --smoke)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per variant (>= 3 for reduce-overhead)")
    ap.add_argument("--variants", default="eager,inductor,inductor-ro,kiln,kiln-ro")
    ap.add_argument("--explain", action="store_true", help="add kiln.explain(timing=True) of the prefill graph")
    ap.add_argument("--explain-baselines", default="eager,inductor", help="what --explain times kiln against")
    ap.add_argument("--kiln-options", type=json.loads, default=None,
                    help='kiln variants\' options as JSON, e.g. \'{"claims": {"attention": false}}\'')  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny model, any device, correctness only, no figures")
    ap.add_argument("--save-smoke", action="store_true", help="with --smoke: write the JSON too (for tests)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "eager" not in variants:
        print(f"--variants {args.variants}: choose among {', '.join(VARIANTS)}, eager included", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench/torch_backend.py needs a CUDA device for figures (--smoke runs without one)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    prefill = args.prefill or (12 if args.smoke else 2048)
    model = build_model(TINY if args.smoke else LLAMA_1B, device, dtype)
    loads = workloads(model, prefill, device)
    results: dict[str, dict] = {}
    graphs: dict[str, int] = {}  # Dynamo graphs compiled per variant: 2 (prefill, decode) unless something recompiled
    failed = []
    errors: dict[str, str] = {}  # a variant (or "explain") that raised: the others still run
    counters = torch._dynamo.utils.counters
    for variant in variants:
        before = counters["stats"]["unique_graphs"]
        results[variant] = {}
        try:
            fwd = compiled_forward(model, variant, args.kiln_options)
            for name, (call, setup, want) in loads.items():
                with torch.no_grad():
                    ms = time_ms(lambda c=call, f=fwd: c(f), setup, 1 if args.smoke else args.iters, args.warmup,
                                 cuda)  # fmt: skip
                    setup()
                    got = call(fwd).clone()  # a CUDA graph's output is overwritten by its next replay
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                row = {"median_ms": statistics.median(ms), "mean_ms": statistics.mean(ms), "rel_err_vs_eager": err}
                results[variant][name] = row
                if err > TOLERANCE[dtype]:
                    failed.append(f"{variant} {name}: relative error {err:.2e} > {TOLERANCE[dtype]:.0e}")
                print(f"{variant:>12} {name:>8}: {row['median_ms']:9.3f} ms  (rel err vs eager {err:.1e})",
                      flush=True)  # fmt: skip
        except Exception as e:  # recorded, exit 1 at the end; the workloads it timed before failing stay
            errors[variant] = f"{type(e).__name__}: {e}"[:2000]
            print(f"ERROR {variant}: {errors[variant][:300]}", file=sys.stderr, flush=True)
        graphs[variant] = counters["stats"]["unique_graphs"] - before
    for rows in results.values():
        for name, row in rows.items():
            for base in ("eager", "inductor"):
                if name in results.get(base, {}):
                    row[f"speedup_vs_{base}"] = results[base][name]["median_ms"] / row["median_ms"]
    for line in failed:
        print(f"MISMATCH {line}", file=sys.stderr)
    save = not args.smoke or args.save_smoke
    out = {
        "bench": "torch_backend", "model": "llama-3.2-1b shape, random weights, bf16, sdpa", "batch": 1,
        "prefill_tokens": prefill, "decode": "1 token, StaticCache", "iters": args.iters, "timing": "CUDA events",
        "kiln_options": args.kiln_options, "results": results, "dynamo_graphs": graphs, "mismatches": failed,
        "errors": errors, **run_metadata(device),
    }  # fmt: skip
    path = result_path(args.out_dir, "torch_backend")
    if save:  # before --explain, which can fail or run out the time limit
        write_json(path, out | ({"explain_prefill": "not yet run"} if args.explain else {}))
    if args.explain:
        torch._dynamo.reset()
        try:
            explained = explain_text(model, prefill, device, 1 if args.smoke else min(args.iters, 10),
                                     args.explain_baselines, args.kiln_options)  # fmt: skip
            out["explain_prefill"] = explained
            print(explained[explained.find("  timing of graph"):])
        except Exception as e:  # recorded, exit 1 at the end
            errors["explain"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"ERROR explain: {errors['explain'][:300]}", file=sys.stderr, flush=True)
        if save:
            write_json(path, out)
    if args.smoke:
        print(f"Dynamo graphs per variant: {graphs}")
        print(f"smoke: {len(variants)} variant(s) x {len(loads)} workloads checked against eager; "
              + (f"wrote {path}" if save else "no figures written"))
    else:
        print(f"wrote {path}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
