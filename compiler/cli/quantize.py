"""`kiln quantize`: quantize a model's weights once (calibrating GPTQ once) and save them as a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path

from kiln.cli.common import (
    QUANTIZE_HELP,
    device_flag,
    dtype_flag,
    model_paths_resolved,
    quantize_flag,
    spec_arg,
    weights_flag,
)
from kiln.cli.paths import check_output_dir, staged_dir
from kiln.cli.text_input import read_text_file
from kiln.errors import UsageError
from kiln.gguf.files import bundled_weights, is_gguf
from kiln.spec.loader import DEFAULT_SPEC, load_spec

# What kiln.tokenizer / kiln.chat_template read from a checkpoint: they travel with the weights, so that
# `kiln run --weights OUT` decodes text and chats as the source does; config.json too, since transformers'
# AutoTokenizer (LLM.get_tokenizer()) takes the class from its model type where tokenizer_config.json names none
# (kiln reads a quantized checkpoint's model from its spec.kiln, never from config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "config.json")


def cmd_quantize(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.pipeline import quantize_graph

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import is_quantized_checkpoint, save_quantized
    from kiln.quant.formats import parse_scheme

    if args.weights and is_quantized_checkpoint(args.weights):
        again = f" (--quantize {args.quantize})" if args.quantize else ""
        raise UsageError(f"--weights {args.weights}: is already a `kiln quantize` output, whose weights cannot be "
                         f"quantized again; quantize the original checkpoint instead{again}")
    out = check_quantize_output(args.output, args.weights)
    spec_scheme = _spec_scheme(args.spec, args.weights)
    if args.quantize is None and spec_scheme is None:
        raise UsageError("kiln quantize needs a scheme, and neither --quantize nor the spec gives one: pass "
                         "--quantize SCHEME (int8, or int4[-rtn|-gptq][-g32|-g64|-g128][-asym]), or write it in the "
                         "spec's compile block, e.g. quantize = int4(method = gptq, calibration = \"calib.txt\")")
    if args.quantize:
        parse_scheme(args.quantize)  # a name that is no scheme (gguf, none, a typo): refused before the model loads
    if args.calibration:
        read_text_file("--calibration", args.calibration)  # missing or not UTF-8: fail before the model loads
    t0 = time.perf_counter()
    # A GGUF's Q4 / Q8 linears are dequantized first (not kept, as on CUDA), so every linear takes this scheme.
    gguf = is_gguf(args.weights if args.weights else bundled_weights(args.spec))
    # The scheme `kiln run` would quantize with (the spec's `quantize`, the flag over it: kiln.build.with_quantize),
    # its int4 group fitted to this model, so that running OUT is running the source with the same --quantize.
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device,
                   quantize=args.quantize or ("none" if gguf else None))
    scheme = m.compile.extra["quantize"]
    if args.calibration:
        if scheme.method == "gptq":
            scheme = dataclasses.replace(scheme, calibration=args.calibration)
        else:  # not recorded in quantization.json either: it did not shape these weights
            say(f"note: --calibration is not used: {scheme.label} rounds each weight on its own (only GPTQ "
                "calibrates)")
    elif args.quantize and scheme.method != "gptq" and spec_scheme is not None and spec_scheme.calibration:
        say(f"note: the spec's calibration file {spec_scheme.calibration} is not used: --quantize {args.quantize} "
            "rounds each weight on its own (only GPTQ calibrates)")
    on = f"{scheme.calibration}" if scheme.calibration else f"{scheme.tokens} seeded random tokens"
    say(f"quantizing {m.model.name} to {scheme.label}" + (f" (calibrating on {on})" if scheme.method == "gptq" else ""))
    gm = quantize_graph(m.gm, scheme, tokenizer=m.tokenizer, route=m.model.route is not None)
    with staged_dir("-o", out) as stage:
        save_quantized(gm, stage, m.model)
        save_tokenizer(m.tokenizer, args.weights, stage)
        written = {p.name for p in stage.iterdir()}
    for name in TOKENIZER_FILES:  # a previous output's tokenizer files that this model lacks must not linger
        if name not in written and (out / name).is_file():
            (out / name).unlink()
    say(f"wrote {out} in {time.perf_counter() - t0:.1f}s; run it with `kiln run --weights {out}`")
    return 0


def _spec_scheme(spec: str | None, weights: str | None):
    """The spec's own `quantize` (a kiln.quant.formats.QuantScheme), None when it has none; read without loading any
    weights. No spec: a checkpoint's config.json says nothing of quantizing (without weights either, kiln's default
    spec is the model)."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.quant.formats import as_scheme

    if spec is None and weights:
        return None
    scheme = load_spec(spec if spec is not None else DEFAULT_SPEC).compile.extra.get("quantize")
    return as_scheme(scheme) if scheme else None


def check_quantize_output(output: str, weights: str | None) -> Path:
    """-o checked before any work: a writable directory that is new, empty or a previous `kiln quantize` output
    (replaced), never the source checkpoint nor a directory holding other files."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import is_quantized_checkpoint

    if not output.strip():
        raise UsageError("-o '': give the directory to write the checkpoint to, e.g. -o model-int8")
    out = check_output_dir("-o", output)
    if weights and out.resolve() == Path(weights).resolve():
        raise UsageError(f"-o {output}: is the source checkpoint (--weights {weights}); writing there would replace "
                         "its weights: choose a new directory")
    if out.is_dir() and any(out.iterdir()) and not is_quantized_checkpoint(out):
        raise UsageError(f"-o {output}: is a directory holding other files (not a `kiln quantize` output, which "
                         "would be replaced); choose a new or empty directory")
    return out


def save_tokenizer(tokenizer: object, weights: str | None, out: Path) -> None:
    """Write the source's tokenizer and chat template into the checkpoint `out`: a checkpoint directory's files
    copied, a GGUF's tokenizer written as those files (kiln.tokenizer reads both back the same way)."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.gguf.tokenizer import GGUFTokenizer

    if isinstance(tokenizer, GGUFTokenizer):
        tokenizer.save_checkpoint_files(out)
    elif weights and Path(weights).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(weights) / name).is_file():
                shutil.copy(Path(weights) / name, out / name)


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    qz = sub.add_parser("quantize", help="quantize a model's weights once and save them",
                        description="Quantize a model's weights (calibrating GPTQ once) and save a checkpoint that "
                        "`kiln run --weights OUT` and the Python API load without calibrating again.")
    spec_arg(qz)
    weights_flag(qz, help="a Hugging Face checkpoint dir or a .gguf file, in full "
                 "precision or GGUF-quantized (default: the spec's bundled or seeded random weights)")
    quantize_flag(qz, help=QUANTIZE_HELP[:-1] + ": sets the format and method; the spec's lm_head, embeddings and "
                  "GPTQ calibration stay; default: the spec's `quantize`, which is then needed)")
    qz.add_argument("--calibration", metavar="FILE", help="calibration text for GPTQ (default: the spec's "
                    "`calibration`, else seeded random tokens)")
    qz.add_argument("-o", "--output", metavar="OUT_DIR", required=True, help="where to write the checkpoint: a new "
                    "or empty directory, or a previous `kiln quantize` output (replaced)")
    device_flag(qz)
    dtype_flag(qz)
    qz.set_defaults(func=model_paths_resolved(cmd_quantize))
