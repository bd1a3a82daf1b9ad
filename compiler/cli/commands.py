"""The `kiln` command line: run, check, fmt, import, compile, quantize, bench.

The error contract: only KilnError is a user error: one message naming the file, flag or value and the fix, no
traceback, exit 2 (argparse's own flag errors exit 2 too). Any other exception is a bug in kiln: its traceback
is printed with one line saying so, and the exit status is 1. `--debug` re-raises everything, traceback
included. A closed stdout (`kiln run ... | head -c 1`) ends the command quietly with 141, as SIGPIPE ends Unix
tools. Output files and directories are checked before any work and written whole or not at all.
Generated text goes to stdout, everything else (timings, notes, progress) to stderr; diagnostics from inside
kiln go through the `kiln` logger, which main() routes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from kiln.cli.bench import add_bench_parser
from kiln.cli.common import (
    QUANTIZE_HELP,
    check_input_file,
    check_output_dir,
    check_output_file,
    dtype_flag,
    engine_flags,
    seed_arg,
    serving_engine,
    setup_logging,
    staged_dir,
    write_file_atomic,
)
from kiln.cli.gguf import chat_prompt
from kiln.cli.serve import add_serve_parser
from kiln.errors import KilnError, SpecError, UsageError
from kiln.hf.config import import_spec
from kiln.spec.formatter import format_spec
from kiln.spec.loader import load_spec, read_spec_file
from kiln.spec.parser import parse_spec
from kiln.spec.validate import DTYPE_BYTES, describe_route, format_bytes, format_count, param_count

EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away
REPORT_BUGS = "the kiln issue tracker"


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty; give at least one token id, e.g. 1,2,3")
    return ids


def cmd_run(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.runtime.sampler import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    params.validate()
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device, seed=args.seed or 0,
                   quantize=args.quantize)
    prompt = args.prompt
    if args.chat and args.prompt_ids is None:

        prompt = chat_prompt(m.tokenizer, prompt)
    prompt_ids = args.prompt_ids if args.prompt_ids is not None else m.tokenizer.encode(prompt)
    # One request: the pool only needs room for it (a longer one is refused below with the model's context).
    total = len(prompt_ids) + params.max_tokens
    engine = serving_engine(args, m, max_num_seqs=1, max_model_len=total if total <= m.model.context else None)
    say(f"loaded {m.model.name} from {m.source} on {m.device} ({m.compile.dtype}) in {time.perf_counter() - t0:.2f}s")
    engine.add_request(prompt_token_ids=prompt_ids, params=params)
    final = None
    for out in engine.stream():
        if not args.json:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        final = out
    assert final is not None and final.finished
    if final.outputs[0].finish_reason == "error":  # e.g. NaN logits: the engine says why; no traceback
        raise KilnError(final.error or "generation failed")
    gen, metrics = final.outputs[0], final.metrics
    n = len(gen.token_ids)
    decode_s = metrics.finish_time - metrics.first_token_time
    timings = {"ttft_s": metrics.ttft_s, "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0}
    if args.json:
        out = {"token_ids": gen.token_ids, "text": gen.text, "prompt_token_ids": list(prompt_ids),
               "finish_reason": gen.finish_reason, "model": m.model.name, "device": str(m.device), **timings}
        print(json.dumps(out))
    else:
        print()
    say(f"{n} tokens, time to first token {timings['ttft_s'] * 1e3:.1f} ms, "
        f"{timings['decode_tokens_per_s']:.1f} tokens/s (paged KV cache engine)")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    import shutil

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.pipeline import quantize_graph

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import save_quantized
    from kiln.quant.formats import parse_scheme

    out = check_output_dir("-o", args.output)
    check_input_file("--calibration", args.calibration)
    scheme = parse_scheme(args.quantize)
    if args.calibration:
        scheme = dataclasses.replace(scheme, calibration=args.calibration)
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device)
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


def cmd_check(args: argparse.Namespace) -> int:
    failed = 0
    for ref in args.specs:
        try:
            loaded = load_spec(ref)
        except SpecError as e:
            failed += 1
            n = len(e.diagnostics)
            print(f"{e}\n{ref}: {n} error{'s' if n != 1 else ''}", file=sys.stderr)
        except KilnError as e:  # unreadable, a directory, no such spec: report it and check the rest
            failed += 1
            print(f"kiln: error: {e}", file=sys.stderr)
        else:
            n, dtype = param_count(loaded.model), loaded.compile.dtype
            route = describe_route(loaded.model)
            print(f"{loaded.path}: ok ({loaded.model.name}, {loaded.model.layers} layers, {format_count(n)} "
                  f"parameters, {format_bytes(n * DTYPE_BYTES[dtype])} of weights in {dtype})"
                  + (f"; {route}" if route else ""))
    return EXIT_USER_ERROR if failed else 0


def cmd_fmt(args: argparse.Namespace) -> int:
    status = 0
    for ref in args.specs:
        path = Path(ref)
        if not path.is_file():
            raise UsageError(f"{ref}: no such spec file; check the path")
        source = read_spec_file(path)
        text = format_spec(parse_spec(source, str(path)))
        if args.check:
            if text != source:
                print(f"{path}: would be reformatted", file=sys.stderr)
                status = 1
        elif args.write:
            if text != source:
                write_file_atomic("--write", path, text)
                print(f"{path}: reformatted", file=sys.stderr)
        else:
            sys.stdout.write(text)
    return status


def cmd_import(args: argparse.Namespace) -> int:
    src = Path(args.hf_dir)
    if src.suffix == ".gguf":
        from kiln.cli.gguf import cmd_import_gguf  # lazy: reading a GGUF loads torch and numpy

        return cmd_import_gguf(args)
    out = check_output_file("-o", args.output) if args.output else None
    notes: list[str] = []
    cfg, text = import_spec(args.hf_dir, args.name or "", notes)  # resolved in-process: always passes `kiln check`
    for note in notes:
        print(f"kiln: note: {note}", file=sys.stderr)
    if out is not None:
        write_file_atomic("-o", out, text)
        print(f"kiln: wrote {args.output} ({cfg.name}, {cfg.layers} layers)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _report_gguf_paths(args: argparse.Namespace, comp, dtype) -> None:
    """With GGUF weights (--weights FILE.gguf, or a bundled spec's package), say which tensors loading keeps as
    int4 / int8 and which it dequantizes, as `kiln run`'s load line does: from the tensor types, no data read."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.gguf.config import open_gguf
    from kiln.gguf.files import bundled_weights, is_gguf
    from kiln.gguf.weights import gguf_paths, paths_summary

    weights = args.weights
    if weights is None:
        try:
            weights = bundled_weights(args.spec)
        except KilnError as e:  # compiling needs no weights: note it and go on
            print(f"kiln: note: {e}", file=sys.stderr)
            return
    if weights is None:
        return
    if not is_gguf(weights):
        raise UsageError(f"--weights {weights}: kiln compile reports a .gguf's load paths only; give a .gguf file "
                         "or leave --weights out (compiling needs no weights)")
    # compile targets the generated kernels, where Q4_0 / Q4_1 / Q8_0 linears stay quantized unless a scheme is set
    keep = "quantize" not in comp.extra
    paths = gguf_paths(open_gguf(weights), keep=keep, dtype=dtype)
    then = "" if keep else f"; then requantized by {args.quantize or 'the spec'}'s scheme"
    print(f"kiln: {Path(weights).name}: {paths_summary(paths)}{then}", file=sys.stderr)


def cmd_compile(args: argparse.Namespace) -> int:
    import tempfile

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.driver import compile_model, emit

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.ir.frontend import TORCH_DTYPES, build_graph

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.ir.text import weight_bytes

    emit_dir = check_output_dir("--emit", args.emit) if args.emit else None
    loaded = load_spec(args.spec)
    dtype_name = args.dtype or loaded.compile.dtype
    comp = loaded.compile
    if args.quantize:
        # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
        from kiln.quant.formats import parse_scheme

        comp = dataclasses.replace(comp, extra={**comp.extra, "quantize": parse_scheme(args.quantize)})

    # Meta tensors: the graph and every shape are real, the weights cost no memory (an 8B spec builds instantly).
    def graph():
        return build_graph(loaded.model, dtype=TORCH_DTYPES[dtype_name], device="meta")

    gm = graph()
    n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    if emit_dir is not None:
        with staged_dir("--emit", emit_dir) as stage:
            written = emit(gm, stage, comp)
        print(f"kiln: wrote {len(written)} files under {args.emit} (graphs/ after every pass, kernels/)",
              file=sys.stderr)
        gm = graph()
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_model(gm, comp, use_kernels=True, dump_dir=dump if args.dump_ir else None)
        if args.dump_ir:
            # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
            from kiln.ir.text import format_graph

            sys.stdout.write(format_graph(graph(), title=f"{loaded.model.name}: Level-1 graph (frontend)"))
            for path in sorted(Path(dump).glob("*.txt")):
                sys.stdout.write("\n" + path.read_text())
    size = weight_bytes(compiled.gm)  # after the passes: quantized weights count at their packed size
    if "quantize" in compiled.passes:
        # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
        from kiln.cli.quality import weight_breakdown

        parts = weight_breakdown(compiled.gm)
        print(f"kiln: weights {parts['quantized'] / 2**20:.1f} MiB quantized + {parts['scales_zeros'] / 2**20:.1f} "
              f"MiB scales/zeros + {parts['dense'] / 2**20:.1f} MiB dense (embeddings, norms, unquantized); "
              f"{size / weight_bytes(graph()):.2f}x the {dtype_name} size", file=sys.stderr)
    _report_gguf_paths(args, comp, TORCH_DTYPES[dtype_name])
    if loaded.model.route is not None:  # build_graph's default form: the one serving and `kiln run` use
        print(f"kiln: {describe_route(loaded.model)}; compiled in the causal form (router score > threshold, or "
              "predictor logit > 0; the training form, top capacity per sequence, is for training and perplexity)",
              file=sys.stderr)
    print(f"kiln: {loaded.model.name}: {n_ops} Level-1 ops, {size / 2**20:.1f} MiB of weights in {dtype_name}; "
          f"passes: {', '.join(compiled.passes) or 'none'}; {len(compiled.kernels)} kernels "
          f"({compiled.hits} cache hits, {compiled.misses} rendered and compiled)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln import __version__

    p = argparse.ArgumentParser(prog="kiln", description="kiln: a declarative compiler for LLM inference")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="compile a spec and generate text", description="Compile a spec and generate.")
    r.add_argument("spec", nargs="?", help="a .kiln file or bundled spec name (default: from --weights, else "
                   "the bundled tiny-llama with seeded random weights)")
    r.add_argument("--weights", metavar="DIR", help="a Hugging Face checkpoint dir (config.json + *.safetensors) "
                   "or a .gguf file")
    r.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template (one user turn)")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized with the checkpoint's tokenizer)")
    g.add_argument("--prompt-ids", metavar="1,2,3", type=_ids, help="prompt as comma-separated token ids")
    r.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    r.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    r.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0)")
    r.add_argument("--seed", type=seed_arg, default=None, help="seed for sampling and random weights")
    r.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    dtype_flag(r)
    r.add_argument("--json", action="store_true", help="print one JSON object with token_ids, text and timings")
    r.add_argument("--quantize", metavar="SCHEME", help=QUANTIZE_HELP)
    engine_flags(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("check", help="validate spec files, reporting every error",
                       description="Validate spec files; every error in each file is reported.")
    c.add_argument("specs", nargs="+", metavar="SPEC")
    c.set_defaults(func=cmd_check)

    f = sub.add_parser("fmt", help="print the canonical form of spec files", description="Format spec files.")
    f.add_argument("specs", nargs="+", metavar="SPEC")
    mode = f.add_mutually_exclusive_group()
    mode.add_argument("--write", "-w", action="store_true", help="rewrite the files in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a file is not in canonical form")
    f.set_defaults(func=cmd_fmt)

    i = sub.add_parser("import", help="write a spec for a Hugging Face checkpoint or a GGUF file",
                       description="Read a HF checkpoint's config.json (or a GGUF file's metadata) and write the "
                       "matching .kiln spec.")
    i.add_argument("hf_dir", metavar="HF_DIR|FILE.gguf")
    i.add_argument("-o", "--output", metavar="FILE.kiln", help="output file (default: stdout)")
    i.add_argument("--name", help="model name in the spec (default: the directory name)")
    i.set_defaults(func=cmd_import)

    k = sub.add_parser("compile", help="build a spec's graph and show it",
                       description="Build a spec's graph on meta tensors (no weight memory), run the passes, "
                       "render and compile its kernels (cached on disk), and report it.")
    k.add_argument("spec", metavar="SPEC")
    k.add_argument("--dump-ir", action="store_true",
                   help="print the graph after the frontend and after every pass, one op per line with shapes")
    k.add_argument("--emit", metavar="DIR", help="write the graph after every pass and every generated kernel "
                   "(a .py file with a header naming op, shapes, dtypes and tile config) under DIR")
    dtype_flag(k)
    k.add_argument("--quantize", metavar="SCHEME", help=QUANTIZE_HELP)
    k.add_argument("--weights", metavar="FILE.gguf", help="a GGUF whose tensors' load paths (kept int4 / int8 or "
                   "dequantized) to report (default: a bundled spec's own GGUF)")
    k.set_defaults(func=cmd_compile)

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

    add_bench_parser(sub)

    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.debug)
    try:
        return args.func(args)
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KilnError as e:
        if args.debug:
            raise
        msg = str(e)
        print(msg if isinstance(e, SpecError) else f"kiln: error: {msg}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception:
        if args.debug:
            raise
        traceback.print_exc()
        print(f"kiln: this is a bug in kiln, not a problem with your input; please report it on {REPORT_BUGS} "
              "with the command line, `kiln --version` and the traceback above", file=sys.stderr)
        return EXIT_BUG


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush into the closed pipe stays quiet."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in-process)
        pass


if __name__ == "__main__":
    sys.exit(main())
