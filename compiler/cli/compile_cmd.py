"""`kiln compile`: build a spec's graph on meta tensors, run the passes, render and compile its kernels, report."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kiln.cli.common import QUANTIZE_HELP, dtype_flag, quantize_flag, weights_flag
from kiln.cli.paths import check_output_dir, staged_dir
from kiln.errors import KilnError, UsageError
from kiln.gguf.config import open_gguf
from kiln.gguf.files import bundled_weights, is_gguf
from kiln.hf.spec_match import check_spec_matches
from kiln.model_config import DTYPE_AUTO, CompileConfig, ModelConfig
from kiln.model_config import dtype_name as normalize_dtype
from kiln.spec.loader import load_spec
from kiln.spec.route import describe_route


def _report_gguf_paths(args: argparse.Namespace, comp, dtype) -> None:
    """With GGUF weights (--weights FILE.gguf, or a bundled spec's package), say which tensors loading keeps as
    int4 / int8 and which it dequantizes, as `kiln run`'s load line does: from the tensor types, no data read."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
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


EMIT_MANIFEST = ".kiln-emit"  # in an --emit directory: the files that emit wrote, which the next emit removes
_EMIT_SUBDIRS = ("graphs", "kernels")


def _check_emit_dir(path: Path) -> None:
    """Refuse (before any work) a directory whose graphs/ or kernels/ kiln did not write: an emit would mix its
    files with someone else's, and clearing them could delete the user's."""
    if (path / EMIT_MANIFEST).is_file():
        return
    found = [d for d in _EMIT_SUBDIRS if (path / d).exists()]
    if found:
        raise UsageError(f"--emit {path}: holds {' and '.join(d + '/' for d in found)} that an earlier `kiln compile "
                         f"--emit` did not write (no {EMIT_MANIFEST} file); give a new or empty directory, or "
                         "remove them")


def _clear_earlier_emit(path: Path) -> None:
    """Remove the files an earlier emit into `path` wrote (its manifest lists them), so that no graph or kernel of
    another model or compile stays beside the new ones; nothing else in `path` is touched."""
    manifest = path / EMIT_MANIFEST
    if not manifest.is_file():
        return
    for line in manifest.read_text(encoding="utf-8").splitlines():
        rel = Path(line)
        if rel.is_absolute() or ".." in rel.parts or len(rel.parts) < 2 or rel.parts[0] not in _EMIT_SUBDIRS:
            continue  # the comment line, or not something emit writes (graphs/... and kernels/...)
        (path / rel).unlink(missing_ok=True)
    for d in _EMIT_SUBDIRS:
        if (path / d).is_dir() and not any((path / d).iterdir()):
            (path / d).rmdir()


def cmd_compile(args: argparse.Namespace) -> int:
    import tempfile

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.codegen import autotune

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.driver import compile_model, emit, kernels_usable

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.ir.frontend import TORCH_DTYPES, build_graph

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.ir.text import format_graph, weight_bytes

    tuned_before = dataclasses.replace(autotune.stats())
    if not kernels_usable():  # before any work: it renders and loads every kernel of the step
        raise KilnError("kiln compile loads the kernels it renders: it needs CUDA, or Triton's interpreter on a CPU; "
                        "run it as `TRITON_INTERPRET=1 kiln compile ...` (`kiln check` checks a spec without kernels)")

    emit_dir = check_output_dir("--emit", args.emit) if args.emit else None
    if emit_dir is not None:
        _check_emit_dir(emit_dir)
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import describe_model, fit_quantize, quantize_label, resolve_model_paths

    args.spec, weights = resolve_model_paths(args.spec, args.weights)
    stored = _quantized_checkpoint(weights)
    if stored is not None:  # a `kiln quantize` output: compiled as `kiln run` runs it, with its stored scheme
        model, comp = _stored_model(args, stored)
    elif args.spec is None:  # a checkpoint dir or a .gguf named as the model: its shapes, kiln's default compile block
        model, comp = describe_model(None, weights), CompileConfig()
        args.weights = weights if is_gguf(weights) else None  # only a .gguf has load paths to report
    else:
        loaded = load_spec(args.spec)
        model, comp = loaded.model, loaded.compile
    dtype_name = normalize_dtype(args.dtype)
    if dtype_name in (None, DTYPE_AUTO):
        dtype_name = comp.dtype

    if args.quantize and stored is None:
        # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
        from kiln.build import with_quantize

        comp = with_quantize(comp, args.quantize)  # the flag over the spec's scheme, as `kiln run` takes it
    comp = fit_quantize(comp, model)  # a scheme without a group gets the one that fits (kiln.quant.sizing)
    quant_label = quantize_label(comp)
    scheme = comp.extra.get("quantize")
    if scheme is not None and scheme.method == "gptq":
        # GPTQ changes the weights' values, not the graph: the same ops, shapes and kernels as round-to-nearest.
        # Meta tensors have no values to calibrate on, so compile builds the RTN twin and says so.
        comp = dataclasses.replace(comp, extra={**comp.extra, "quantize": dataclasses.replace(scheme, method="rtn")})
        when = (f"calibrated when `kiln quantize` wrote {stored}" if stored is not None else
                "calibrates when weights load (`kiln run`, `kiln serve`, `kiln quantize`)")
        print(f"kiln: note: {quant_label}: GPTQ {when}; its graph and kernels are those of round-to-nearest, which "
              "compile builds here", file=sys.stderr)

    # Meta tensors: the graph and every shape are real, the weights cost no memory (an 8B spec builds instantly).
    def graph():
        return build_graph(model, dtype=TORCH_DTYPES[dtype_name], device="meta")

    gm = graph()
    n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    if emit_dir is not None:
        with staged_dir("--emit", emit_dir) as stage:
            written = emit(gm, stage, comp)
            listed = "\n".join(str(p.relative_to(stage)) for p in written)
            (stage / EMIT_MANIFEST).write_text(f"# written by kiln compile --emit; the next --emit into this "
                                               f"directory replaces these files\n{listed}\n", encoding="utf-8")
            _clear_earlier_emit(emit_dir)  # the new files move in when this block ends
        print(f"kiln: wrote {len(written)} files under {args.emit} (graphs/ after every pass, kernels/)",
              file=sys.stderr)
        gm = graph()
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_model(gm, comp, use_kernels=True, dump_dir=dump if args.dump_ir else None)
        if args.dump_ir:
            sys.stdout.write(format_graph(graph(), title=f"{model.name}: Level-1 graph (frontend)"))
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
    if stored is None:  # a `kiln quantize` output's weights load as stored, never from a GGUF
        _report_gguf_paths(args, comp, TORCH_DTYPES[dtype_name])
    if model.route is not None:  # build_graph's default form: the one serving and `kiln run` use
        print(f"kiln: {describe_route(model)}; compiled in the causal form (router score > threshold, or "
              "predictor logit > 0; the training form, top capacity per sequence, is for training and perplexity)",
              file=sys.stderr)
    print(f"kiln: {model.name}: {n_ops} Level-1 ops, {size / 2**20:.1f} MiB of weights in {dtype_name}; "
          f"passes: {', '.join(_pass_names(compiled.passes, quant_label)) or 'none'}; "
          f"{len(compiled.kernels)} kernels "
          f"({compiled.hits} cache hits, {compiled.misses} rendered and compiled); "
          f"{autotune.stats().since(tuned_before).summary()}", file=sys.stderr)
    return 0


def _quantized_checkpoint(weights: str | None) -> Path | None:
    """weights as a `kiln quantize` output's directory, else None."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import is_quantized_checkpoint

    return Path(weights) if weights is not None and is_quantized_checkpoint(weights) else None


def _stored_model(args: argparse.Namespace, stored: Path) -> tuple[ModelConfig, CompileConfig]:
    """The model and compile config of a `kiln quantize` output, as `kiln run` loads it: its spec.kiln's model (or
    the spec given with it, which must describe the same model), compiled with the stored scheme and dtype; a
    --quantize or --dtype that differs from them is refused with `kiln run`'s message."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.quantized import SPEC, check_stored_settings

    own = load_spec(stored / SPEC)
    loaded = own if args.spec is None else load_spec(args.spec)
    if args.spec is not None:
        check_spec_matches(loaded.model, own.model, loaded.path, str(stored / SPEC))
    dtype = normalize_dtype(args.dtype)
    scheme, dtype = check_stored_settings(stored, loaded.model, quantize=args.quantize,
                                          dtype=None if dtype in (None, DTYPE_AUTO) else dtype)
    return loaded.model, dataclasses.replace(loaded.compile, dtype=dtype,
                                             extra={**loaded.compile.extra, "quantize": scheme})


def _pass_names(passes: list[str], quant: str | None) -> list[str]:
    """The passes that ran, the quantize pass with its scheme (e.g. `quantize (int4-rtn-g64)`)."""
    return [f"{p} ({quant})" if p == "quantize" and quant else p for p in passes]


def add_compile_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("compile", help="build a spec's graph and show it",
                       description="Build a spec's graph on meta tensors (no weight memory), run the passes, "
                       "render and compile its kernels (cached on disk), and report it.")
    k.add_argument("spec", metavar="SPEC", help="a .kiln file or bundled spec name, or a Hugging Face checkpoint dir "
                   "or a .gguf file (its config, kiln's default compile block)")
    k.add_argument("--dump-ir", action="store_true",
                   help="print the graph after the frontend and after every pass, one op per line with shapes")
    k.add_argument("--emit", metavar="DIR", help="write the graph after every pass and every generated kernel "
                   "(a .py file with a header naming op, shapes, dtypes and tile config) under DIR")
    dtype_flag(k)
    quantize_flag(k, help=QUANTIZE_HELP)
    weights_flag(k, metavar="FILE.gguf", help="a GGUF whose tensors' load paths (kept int4 / int8 or "
                 "dequantized) to report (default: a bundled spec's own GGUF), or a `kiln quantize` output to "
                 "compile as stored")
    k.set_defaults(func=cmd_compile)
