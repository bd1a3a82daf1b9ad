"""Serving throughput: kiln's engine (continuous batching) against Hugging Face transformers' static batched
`generate`, on the same model with the same random weights and the same seeded trace, in the same run.

    python bench/serving_vs_hf.py [SPEC] [--num-requests 256] [--input-len 100:1024] [--output-len 100:1024]
                                  [--batch-size 32] [--max-num-seqs N] [--dtype bf16] [--device auto] [--json]

The spec (llama family only) becomes a transformers LlamaConfig; that model is built with seeded random
weights and saved to a temporary checkpoint, which kiln then loads like `--weights DIR`. Prints output
tokens/s and requests/s of both and the ratio; on CUDA the target is a ratio of at least 3 (exit 1 when
missed). Writes bench/results/serving_vs_hf-<model>-<device>-<date>.json (--out-dir to change where): first
once HF's half is measured (`"status": "partial: ..."`, so a run stopped during kiln's half keeps it), then
complete (`"status": "complete"`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json

from kiln.build import load_model, resolve_device
from kiln.compile.step import compile_step
from kiln.errors import KilnError
from kiln.hf.config import config_from_hf
from kiln.ir.frontend import TORCH_DTYPES
from kiln.model_config import ModelConfig
from kiln.runtime.engine import Engine
from kiln.runtime.throughput import TraceRequest, make_trace, parse_range, run_trace
from kiln.spec.loader import load_spec

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 3.0
PAD = 0


def say(msg: str) -> None:
    print(f"serving_vs_hf: {msg}", file=sys.stderr, flush=True)


def hf_config(cfg: ModelConfig):
    """The transformers LlamaConfig of a llama-family ModelConfig; anything else is refused (SystemExit)."""
    from transformers import LlamaConfig

    refuse = (f"{cfg.name}: only llama-family specs (rms norm, rope, attention + swiglu mlp per layer, no biases "
              "or sliding window) can be compared with transformers' LlamaForCausalLM")
    if cfg.rope is None or cfg.positions != "rope" or cfg.norm.kind != "rms" or not cfg.final_norm:
        raise SystemExit(refuse)
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope.theta}
    s = cfg.rope.scaling
    if s is not None and s.kind == "llama3":
        rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                 "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_context}
    elif s is not None:
        rope |= {"rope_type": s.kind, "factor": s.factor}
    hf = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.ffn,
                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.context, rms_norm_eps=cfg.norm.eps,
                     rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
                     attention_bias=False, mlp_bias=False, pad_token_id=PAD)
    # The importer reading this config back must give the spec's model exactly, or the two sides would differ
    # (a different layer body, a window, biases): that round trip is the family check.
    try:
        same = config_from_hf(hf.to_dict(), name=cfg.name) == cfg
    except KilnError:
        same = False
    if not same:
        raise SystemExit(refuse)
    return hf


def save_checkpoint(cfg: ModelConfig, path: Path, *, dtype: torch.dtype, device: torch.device, seed: int):
    """A LlamaForCausalLM with seeded random weights (HF's own init), saved to `path`; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised in place, in `dtype`: no fp32 copy of a 1B model on the CPU first
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype)
    model.save_pretrained(path)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_generate(model, trace: list[TraceRequest], batch_size: int, device: torch.device,
                progress: bool = True) -> dict:
    """Static batches in trace order, left-padded; each batch decodes until its longest output is done."""
    _sync(device)
    start = time.perf_counter()
    generated = 0
    for b0 in range(0, len(trace), batch_size):
        batch = trace[b0:b0 + batch_size]
        width, new = max(len(r.prompt_token_ids) for r in batch), max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        # min_new_tokens masks EOS until the end, so every batch runs exactly `new` decode steps.
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=PAD)
        if out.shape != (len(batch), width + new):
            raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, expected {(len(batch), width + new)}")
        generated += len(batch) * new
        if progress:
            say(f"hf: {b0 + len(batch)}/{len(trace)} requests done, {time.perf_counter() - start:.1f} s")
    _sync(device)
    elapsed = time.perf_counter() - start
    useful = sum(r.output_len for r in trace)  # a request's tokens past its own output_len are padding work
    return {"elapsed_s": elapsed, "requests_per_s": len(trace) / elapsed, "output_tokens_per_s": useful / elapsed,
            "output_tokens": useful, "generated_tokens": generated,
            "batches": -(-len(trace) // batch_size)}


def kiln_engine(m, step, args: argparse.Namespace, max_model_len: int) -> Engine:
    return Engine(step, m.tokenizer, m.model, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_model_len)


def run(args: argparse.Namespace, save=None) -> dict:
    """Both halves; save(result), when given, is called with the partial result once HF's half is measured."""
    from transformers import __version__ as transformers_version

    input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    device = resolve_device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.max_num_seqs = args.max_num_seqs or args.batch_size
    cfg = load_spec(args.spec).model
    trace, clipped = make_trace(args.num_requests, input_len, output_len, vocab=cfg.vocab, context=cfg.context,
                                seed=args.seed)
    # Warm-up requests (a differently seeded trace, short outputs) load kernels outside the timed runs.
    warm, _ = make_trace(args.warmup, input_len, (1, 4), vocab=cfg.vocab, context=cfg.context, seed=args.seed + 1)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in trace + warm)
    if clipped:
        say(f"{clipped} of {len(trace)} requests shortened to fit the context of {cfg.context} tokens")
    result = {
        "model": cfg.name, **run_metadata(), "transformers": transformers_version, "dtype": dtype,
        "trace": {"num_requests": len(trace), "input_len": list(input_len), "output_len": list(output_len),
                  "seed": args.seed, "clipped": clipped, "prompt_tokens": sum(len(r.prompt_token_ids) for r in trace),
                  "output_tokens": sum(r.output_len for r in trace)},
        "config": {"hf_batch_size": args.batch_size, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "warmup_requests": args.warmup},
    }
    with tempfile.TemporaryDirectory(prefix="serving_vs_hf-") as ckpt:
        say(f"building {cfg.name} in transformers ({dtype}, seed {args.seed}) on {device}, saving to {ckpt}")
        model = save_checkpoint(cfg, Path(ckpt), dtype=TORCH_DTYPES[dtype], device=device, seed=args.seed)
        result["config"]["hf_attn_implementation"] = model.config._attn_implementation
        if warm:
            hf_generate(model, warm, args.batch_size, device, progress=False)
        say(f"hf: {len(trace)} requests in static batches of {args.batch_size}")
        result["hf"] = hf_generate(model, trace, args.batch_size, device)
        if save is not None:  # HF's half is most of the time: kept if kiln's half fails or is cut off
            save(result | {"status": "partial: hf measured; kiln, ratio and target not yet"})
        del model  # the HF model leaves the device before kiln's KV pool sizes itself from free memory
        _free(device)

        m = load_model(args.spec, ckpt, dtype=dtype, device=str(device), seed=args.seed)
    step = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=m.device.type == "cuda")
    if warm:
        engine = kiln_engine(m, step, args, longest)
        run_trace(engine, warm, label="warmup-")
        del engine
        _free(device)
    engine = kiln_engine(m, step, args, longest)  # a fresh engine, so its stats count the trace alone
    say(f"kiln: {len(trace)} requests, continuous batching of up to {args.max_num_seqs}, "
        f"{engine.block_manager.num_usable_blocks} KV blocks")
    result["kiln"] = run_trace(engine, trace, label="kiln-", progress=say)
    result["kiln"] |= {"output_tokens": engine.stats.num_generated_tokens,
                       "num_blocks": engine.block_manager.num_usable_blocks}
    hf, kl = result["hf"], result["kiln"]
    result["ratio"] = {k: kl[k] / hf[k] for k in ("output_tokens_per_s", "requests_per_s")}
    on_cuda = device.type == "cuda"
    result["target"] = {"min_ratio": TARGET_RATIO, "applies": on_cuda,
                        "met": result["ratio"]["output_tokens_per_s"] >= TARGET_RATIO if on_cuda else None}
    result["status"] = "complete"
    return result


def report(r: dict) -> str:
    hf, kl, t = r["hf"], r["kiln"], r["target"]
    verdict = (f"{'met' if t['met'] else 'MISSED'} (>= {t['min_ratio']:g}x)" if t["applies"]
               else "not checked (CPU: the target is for CUDA)")
    return "\n".join([
        f"{r['model']} ({r['dtype']}) on {r['device']}: {r['trace']['num_requests']} requests, "
        f"{r['trace']['output_tokens']} output tokens",
        f"{'':34}{'req/s':>9}{'out tok/s':>11}{'seconds':>9}",
        f"{'hf generate, static batches of ' + str(r['config']['hf_batch_size']):34}"
        f"{hf['requests_per_s']:9.2f}{hf['output_tokens_per_s']:11.1f}{hf['elapsed_s']:9.2f}",
        f"{'kiln engine, continuous batching':34}"
        f"{kl['requests_per_s']:9.2f}{kl['output_tokens_per_s']:11.1f}{kl['elapsed_s']:9.2f}",
        f"kiln / hf: {r['ratio']['output_tokens_per_s']:.2f}x output tokens/s; target {verdict}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", nargs="?", default="llama-3.2-1b", help="a llama-family spec (default llama-3.2-1b)")
    p.add_argument("--num-requests", type=int, default=256, help="requests in the trace (default 256)")
    p.add_argument("--input-len", default="100:1024", metavar="LO:HI", help="prompt lengths, uniform (100:1024)")
    p.add_argument("--output-len", default="100:1024", metavar="LO:HI", help="output lengths, uniform (100:1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace and the weights (default 0)")
    p.add_argument("--batch-size", type=int, default=32, help="HF static batch size (default 32)")
    p.add_argument("--max-num-seqs", type=int, help="kiln's running requests at most (default: --batch-size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kiln's tokens per step (2048)")
    p.add_argument("--num-blocks", type=int, help="kiln's KV cache blocks (default: from free memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="kiln's share of GPU memory (0.9)")
    p.add_argument("--warmup", type=int, default=4, help="untimed warm-up requests on each side (default 4)")
    p.add_argument("--dtype", choices=list(TORCH_DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = p.parse_args(argv)
    try:
        parse_range(args.input_len), parse_range(args.output_len)
    except ValueError as e:
        p.error(f"--input-len / --output-len: {e}")
    for flag in ("num_requests", "batch_size", "max_num_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")

    def save(r: dict) -> Path:
        path = write_json(result_path(args.out_dir, f"serving_vs_hf-{r['model']}"), r)
        say(f"wrote {path} ({r['status']})")
        return path

    try:
        r = run(args, save)
    except KilnError as e:
        raise SystemExit(f"serving_vs_hf: {e}") from None
    print(json.dumps(r, indent=2) if args.json else report(r))
    save(r)
    return 1 if r["target"]["met"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
