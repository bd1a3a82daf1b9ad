"""`kiln bench perplexity`'s flags and defaults, apart from perplexity.py: that module loads torch, and building the
`kiln` parser (which `kiln check`, `kiln fmt` and `kiln --help` do) must not. bench.py binds the command."""

from __future__ import annotations

import argparse

from kiln.cli.common import device_flag, spec_arg, weights_flag

DEFAULT_VARIANTS = ("fp32", "bf16", "int8", "int4-rtn-g32", "int4-rtn-g128", "int4-gptq-g32", "int4-gptq-g128")
DEFAULT_WINDOW = 512  # tokens per window, or the model's context when that is shorter


def add_perplexity_parser(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bsub.add_parser("perplexity", help="perplexity on real text for several weight formats",
                        description="Perplexity of a model on a text file, for the dense model in fp32 / bf16, "
                        "kiln's quantization schemes and a GGUF's own quantized tensors (variant gguf).")
    spec_arg(p)
    weights_flag(p, metavar="W", help="a Hugging Face checkpoint dir or a .gguf file (full precision or "
                 "GGUF-quantized; not a `kiln quantize` output)")
    p.add_argument("--text", metavar="FILE", required=True, help="UTF-8 text to score (e.g. bench/data/*.txt)")
    p.add_argument("--variants", metavar="A,B", help=f"default: {','.join(DEFAULT_VARIANTS)} (add gguf for a GGUF; "
                   "kv-int8 / kv-auto: the cached step model with an int8 / model-dtype KV cache)")
    p.add_argument("--window", type=int, help=f"tokens per scored window, at most the model's context (default "
                   f"{DEFAULT_WINDOW}, or the context when shorter)")
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens of the text, N >= 2 (default: all)")
    p.add_argument("--calibration", metavar="FILE", help="GPTQ calibration text (default: seeded random tokens)")
    device_flag(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-o", "--output", metavar="FILE.json", help="also write the result JSON here")
    return p
