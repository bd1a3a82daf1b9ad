"""Pieces the `kiln` subcommands share: the serving engine built from CLI flags, and their help texts."""

from __future__ import annotations

import argparse

QUANTIZE_HELP = ("quantize weights: int8, or int4[-rtn|-gptq][-g32|-g64|-g128][-asym] "
                 "(overrides the spec's `quantize`)")


def step_model(args: argparse.Namespace, m):
    """The compiled step model of a loaded model (kiln.compile.step; m.gm is rewritten in place)."""
    from kiln.compile.step import compile_step

    # Generated kernels on CUDA; on CPU the reference ops (Triton's interpreter is for testing codegen only).
    return compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=m.device.type == "cuda",
                        kv_cache_dtype=args.kv_cache_dtype)


def serving_engine(args: argparse.Namespace, m, step=None, **kw):
    """The serving engine over a loaded model (or an already compiled step model of it), from the shared
    --num-blocks / --block-size / ... flags."""
    from kiln.runtime.engine import Engine

    step = step_model(args, m) if step is None else step
    return Engine(step, m.tokenizer, m.model, num_blocks=args.num_blocks, block_size=args.block_size,
                  gpu_memory_utilization=args.gpu_memory_utilization, **kw)


def engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: from free GPU memory, or a CPU default)")
    p.add_argument("--block-size", type=int, help="tokens per KV cache block (default: the spec's "
                   "kv_cache = paged(block = N), else 16)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], help="KV cache element type: auto (the model "
                   "dtype) or int8 with per-token, per-head scales (default: the spec's kv_cache dtype, else auto)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the weights and KV cache may use (default 0.9)")
