"""The spec-file commands, none of which loads torch: `kiln check` (validate, every error reported), `kiln fmt`
(the canonical form) and `kiln import` (a spec from a Hugging Face config.json or a GGUF file's metadata)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.cli.common import EXIT_USER_ERROR
from kiln.cli.paths import check_output_file, write_file_atomic
from kiln.errors import Diagnostic, KilnError, SpecError, UsageError
from kiln.hf.config import import_spec
from kiln.model_config import INT4_GROUPS, AttentionCall
from kiln.quant.sizing import SchemeView, fitting_group, quantized_bytes, quantized_weights, resolve_group
from kiln.spec.ast import Call, Setting
from kiln.spec.formatter import format_spec
from kiln.spec.limits import format_bytes, format_count, param_count
from kiln.spec.loader import LoadedSpec, bundled_spec, bundled_specs, load_spec, read_spec_file
from kiln.spec.parser import parse_spec
from kiln.spec.speculation import NOT_FOR_MOD
from kiln.spec.speculation import describe as describe_speculation
from kiln.spec.validate import DTYPE_BYTES, describe_route


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
            notes: list[str] = []
            problems = serving_problems(loaded, notes)
            for note in notes:  # what runs, but not as one might expect (a draft model's shorter context)
                print(f"{loaded.path}: note: {note}", file=sys.stderr)
            if problems:
                failed += 1
                print(f"{SpecError(problems)}\n{ref}: {len(problems)} error{'s' if len(problems) != 1 else ''}",
                      file=sys.stderr)
                continue
            n = param_count(loaded.model)
            route = describe_route(loaded.model)
            spec_cfg = loaded.compile.extra.get("speculation")
            speculation = f", speculation {describe_speculation(spec_cfg)}" if spec_cfg else ""
            print(f"{loaded.path}: ok ({loaded.model.name}, {loaded.model.layers} layers, {format_count(n)} "
                  f"parameters, {_weights_size(loaded, n)}{speculation})" + (f"; {route}" if route else ""))
    return EXIT_USER_ERROR if failed else 0


def _diagnostic(loaded: LoadedSpec, node, message: str, hint: str) -> Diagnostic:
    line = node.span.line
    lines = loaded.ast.source.split("\n")
    source = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    return Diagnostic(loaded.path, line, node.span.column, message, hint, source)


def _keyword(setting: Setting | None, name: str):
    """The value node of `name = ...` inside a compile setting's call, else the setting itself."""
    if setting is not None and isinstance(setting.value, Call):
        for kw in setting.value.kwargs:
            if kw.name == name:
                return kw.value
    return setting


def serving_problems(loaded: LoadedSpec, notes: list[str] | None = None) -> list[Diagnostic]:
    """What a valid spec asks for that `kiln run` / `kiln serve` would refuse only after loading: found here so
    that `kiln check` passing means the spec runs. (Not spec errors: `kiln compile` and the Python API build such
    models, and a missing calibration file may be given later with --calibration.) notes: gets what runs but
    deserves a word (a draft model with a shorter context than the target's), as `kiln run` says it at load."""
    out = []
    model, extra = loaded.model, loaded.compile.extra
    settings = {x.key: x for x in loaded.ast.compile.settings} if loaded.ast.compile is not None else {}
    if not any(isinstance(e, AttentionCall) for e in model.sites()):
        out.append(_diagnostic(loaded, loaded.ast.model, f"model `{model.name}` has no attention, so there is no KV "
                               "cache to page and `kiln run` / `kiln serve` cannot serve it",
                               "add e.g. `x = x + attention(norm(x))` to the layer block (`kiln compile` builds it "
                               "as it is)"))
    if model.route is not None and extra.get("speculation") is not None:
        out.append(_diagnostic(loaded, settings["speculation"], "speculation with a Mixture-of-Depths model (route = "
                               f"mod(...)): {NOT_FOR_MOD}", "remove the speculation setting (or run with "
                               "--speculation off), or the route setting"))
    draft = extra.get("speculation")
    if draft is not None and draft.kind == "draft" and model.route is None:
        # lazy: reading a checkpoint's config goes through kiln.build, which loads torch (only for a draft model)
        from kiln.speculation import check_draft, draft_context_note

        try:
            draft_model = check_draft(draft, model, loaded.path)
        except KilnError as e:
            out.append(_diagnostic(loaded, settings["speculation"], str(e), "give a draft model of the target's "
                                   "family (the same tokenizer), dense; a relative path starts at the spec's folder"))
        else:
            note = draft_context_note(draft, draft_model, model)
            if note is not None and notes is not None:
                notes.append(note)
    quantize = extra.get("quantize")
    if quantize and quantize["bits"] == 4:
        scheme = SchemeView.of(quantize)
        weights = quantized_weights(model, lm_head=scheme.lm_head, embeddings=scheme.embeddings)
        unfit = next(((n, s) for n, s in weights.items() if s[1] % min(INT4_GROUPS)), None)
        bad = next(((n, s) for n, s in weights.items() if s[1] % scheme.group), None)
        if unfit is not None:  # whatever the group: a plain `int4` too
            out.append(_diagnostic(loaded, settings["quantize"].value, f"no int4 group fits {unfit[0]}: its K = "
                                   f"{unfit[1][1]} is not a multiple of {min(INT4_GROUPS)}, the smallest int4 group",
                                   "use quantize = int8, or leave this model unquantized"))
        elif bad is not None and not quantize.get("auto_group"):
            fits = fitting_group([s[1] for s in weights.values()])
            out.append(_diagnostic(loaded, _keyword(settings.get("quantize"), "group"),
                                   f"int4 group {scheme.group} does not divide {bad[0]}'s K = {bad[1][1]}",
                                   (f"use group = {fits}, or " if fits else "") + "leave group out to take the "
                                   "largest group that fits"))
    # only GPTQ reads the calibration text: round-to-nearest never opens it
    calibration = quantize.get("calibration") if quantize and quantize.get("method") == "gptq" else None
    if calibration and not Path(calibration).is_file():
        out.append(_diagnostic(loaded, _keyword(settings.get("quantize"), "calibration"),
                               f"calibration file {calibration} "
                               + ("is not a file" if Path(calibration).exists() else "does not exist"),
                               "a relative path starts at the spec file's folder; give a text file, or drop "
                               "calibration to calibrate on seeded random tokens"))
    return sorted(out, key=lambda d: (d.line, d.column))


def _weights_size(loaded, n: int) -> str:
    """The weights' size in the compile dtype, after the spec's `quantize` scheme when it has one."""
    dtype = loaded.compile.dtype
    dense = format_bytes(n * DTYPE_BYTES[dtype])
    quantize = loaded.compile.extra.get("quantize")
    if not quantize:
        return f"{dense} of weights in {dtype}"
    scheme = resolve_group(SchemeView.of(quantize), loaded.model)[0]
    size = format_bytes(quantized_bytes(loaded.model, DTYPE_BYTES[dtype], scheme))
    return f"{size} of weights quantized to {scheme.label}, the rest in {dtype} ({dense} unquantized)"


def cmd_fmt(args: argparse.Namespace) -> int:
    status = 0
    for ref in args.specs:
        path = Path(ref)
        if path.is_dir():  # the words `kiln check` uses
            raise UsageError(f"{ref}: is a directory, not a spec file; pass a .kiln file or a bundled spec name")
        if path.is_file():
            source = read_spec_file(path)
        else:  # a bundled name, as `kiln check` takes: printed and checked, never rewritten
            res = bundled_spec(ref)
            if res is None:
                raise UsageError(f"{ref}: no such spec file or bundled spec; bundled specs are: "
                                 f"{', '.join(bundled_specs())}")
            if args.write:
                raise UsageError(f"{ref}: is a bundled spec, part of kiln's installed package; --write rewrites your "
                                 f"own files only: copy it first (`kiln fmt {ref} > {ref}.kiln`)")
            source, path = res.read_text(encoding="utf-8"), Path(str(res))
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
        from kiln.cli.gguf import cmd_import_gguf  # lazy: reading a GGUF loads numpy, which `kiln check` never needs

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


def add_spec_file_parsers(sub: argparse._SubParsersAction) -> None:
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
    i.add_argument("--name", help="model name in the spec (default: the checkpoint directory's name; for a GGUF, "
                   "its general.name metadata, else the file name)")
    i.set_defaults(func=cmd_import)
