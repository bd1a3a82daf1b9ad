"""`kiln quantize`: quantize a model's weights once (calibrating GPTQ once) and save them as a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path

from kiln.cli.common import QUANTIZE_HELP, check_input_file, check_output_dir, dtype_flag, staged_dir


def cmd_quantize(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.pipeline import quantize_graph

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import save_quantized
    from kiln.quant.formats import parse_scheme
    from kiln.quant.sizing import resolve_group

    out = check_output_dir("-o", args.output)
    check_input_file("--calibration", args.calibration)
    scheme = parse_scheme(args.quantize)
    if args.calibration:
        scheme = dataclasses.replace(scheme, calibration=args.calibration)
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device)
    scheme, note = resolve_group(scheme, m.model)  # a scheme without a group gets the one that fits this model
    if note:
        say(f"note: {note}")
    say(f"quantizing {m.model.name} to {scheme.label}" + (" (calibrating)" if scheme.method == "gptq" else ""))
    gm = quantize_graph(m.gm, scheme, tokenizer=m.tokenizer)
    with staged_dir("-o", out) as stage:
        save_quantized(gm, stage, m.model)
        if args.weights:  # the tokenizer travels with the weights, so `kiln run --weights OUT` decodes text
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if (Path(args.weights) / name).is_file():
                    shutil.copy(Path(args.weights) / name, stage / name)
    say(f"wrote {out} in {time.perf_counter() - t0:.1f}s; run it with `kiln run --weights {out}`")
    return 0


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    qz = sub.add_parser("quantize", help="quantize a model's weights once and save them",
                        description="Quantize a model's weights (calibrating GPTQ once) and save a checkpoint that "
                        "`kiln run --weights OUT` and the Python API load without calibrating again.")
    qz.add_argument("spec", metavar="SPEC", nargs="?", help="a .kiln file or bundled spec name (default: from "
                    "--weights, else tiny-llama)")
    qz.add_argument("--weights", metavar="DIR", help="a Hugging Face checkpoint dir (default: seeded random weights)")
    qz.add_argument("--quantize", metavar="SCHEME", required=True, help=QUANTIZE_HELP)
    qz.add_argument("--calibration", metavar="FILE", help="calibration text for GPTQ (default: seeded random tokens)")
    qz.add_argument("-o", "--output", metavar="OUT_DIR", required=True, help="where to write the checkpoint")
    qz.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    dtype_flag(qz)
    qz.set_defaults(func=cmd_quantize)
