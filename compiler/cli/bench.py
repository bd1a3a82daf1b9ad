"""`kiln bench throughput`, `kiln bench quality` and `kiln bench perplexity` (their work in quality.py and
perplexity.py, which load torch) and the parser of `bench` (perplexity's flags from perplexity_parser.py, `bench
serve`'s from serve.py)."""

from __future__ import annotations

import argparse
import json

from kiln.cli.common import (
    FULL_PRECISION_WEIGHTS_HELP,
    batch_limit_flags,
    device_flag,
    dtype_flag,
    engine_flags,
    model_paths_resolved,
    positive_int,
    quantize_flag,
    routers_flag,
    seed_flag,
    serving_engine,
    spec_arg,
    step_model,
    weights_flag,
)
from kiln.cli.paths import check_input_file
from kiln.cli.perplexity_parser import add_perplexity_parser
from kiln.cli.serve import add_bench_serve_parser
from kiln.errors import KilnError, UsageError
from kiln.spec.speculation import describe


def cmd_bench(args: argparse.Namespace) -> int:
    import gc

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.run_info import run_metadata

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.runtime.throughput import format_report, make_trace, parse_range, run_trace, warm_up

    try:
        input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    except ValueError as e:
        raise UsageError(f"--input-len / --output-len: {e}") from None
    if args.num_requests < 1:
        raise UsageError(f"--num-requests {args.num_requests}: give at least 1")
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device, seed=args.seed,
                   quantize=args.quantize, routers=args.routers)
    trace, clipped = make_trace(args.num_requests, input_len, output_len, vocab=m.model.vocab,
                                context=m.model.context, seed=args.seed)
    if clipped:
        say(f"{clipped} of {len(trace)} requests shortened to fit the context of {m.model.context} tokens")
    result = {"model": m.model.name, **run_metadata(m.device),
              "trace": {"num_requests": len(trace), "input_len": list(input_len), "output_len": list(output_len),
                        "seed": args.seed, "clipped": clipped,
                        "prompt_tokens": sum(len(r.prompt_token_ids) for r in trace),
                        "output_tokens": sum(r.output_len for r in trace)},
              "config": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "block_size": args.block_size, "num_blocks": args.num_blocks, "dtype": m.compile.dtype,
                         "kv_cache_dtype": args.kv_cache_dtype, "quantize": m.quantize_label()}}
    step = step_model(args, m)  # compiled once; each policy gets its own engine and KV pool over it
    plan = getattr(args, "draft_plan", None)
    result["config"]["speculation"] = describe(plan.config) if plan is not None else "off"
    for policy in ("warm-up", "continuous", "static"):
        engine = serving_engine(args, m, step, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                scheduling_policy="continuous" if policy == "warm-up" else policy)
        if policy == "warm-up":  # its own engine: the timed runs start with equal, warm process state
            result["warmup"] = warm_up(engine, vocab=m.model.vocab, context=m.model.context)
            say(f"warm-up: {result['warmup']['requests']} requests, untimed, {result['warmup']['elapsed_s']:.2f} s")
        else:
            say(f"bench {policy}: {len(trace)} requests on {m.device}, {engine.block_manager.num_usable_blocks} KV "
                "blocks")
            prof = _start_profile() if args.profile and policy == "continuous" else None
            result[policy] = run_trace(engine, trace, label=f"{policy}-", progress=say)
            if prof is not None:
                result["profile"] = _write_profile(prof, args.profile)
                say(f"cProfile summary of the continuous run written to {args.profile}")
            result[policy]["num_blocks"] = engine.block_manager.num_usable_blocks
        del engine  # free this pool before the next one is allocated
        gc.collect()
        if m.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    c, st = result["continuous"], result["static"]
    result["speedup"] = {"output_tokens_per_s": c["output_tokens_per_s"] / st["output_tokens_per_s"],
                         "requests_per_s": c["requests_per_s"] / st["requests_per_s"],
                         "ttft_mean": st["ttft_s"]["mean"] / max(c["ttft_s"]["mean"], 1e-9)}
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def _start_profile():
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _write_profile(prof, path: str, top: int = 40) -> str:
    """The host-side profile of a run: the top functions by cumulative and by own time, as text."""
    import io
    import pstats
    from pathlib import Path

    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    for key in ("cumulative", "tottime"):
        buf.write(f"==== top {top} by {key} ====\n")
        stats.sort_stats(key).print_stats(top)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(buf.getvalue())
    return path


def cmd_bench_quality(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.cli.quality import bench_quality_main

    check_input_file("--eval-text", args.eval_text)
    check_input_file("--calibration", args.calibration)
    schemes = [s for s in args.schemes.split(",") if s] if args.schemes else None  # None: the adapted defaults
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.quant.formats import parse_scheme

    for s in schemes or ():  # checked before the model loads, naming this flag
        try:
            parse_scheme(s)
        except KilnError:
            raise UsageError(f"--schemes: {s!r} is not a quantization scheme; give a comma-separated list of "
                            "int8 or int4[-rtn|-gptq][-g32|-g64|-g128][-asym]") from None
    bench_quality_main(args.spec, args.weights, schemes=schemes, positions=args.positions, eval_text=args.eval_text,
                       calibration=args.calibration, dtype=args.dtype, device=args.device, json=args.json)
    return 0


def cmd_bench_perplexity(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.cli.perplexity import bench_perplexity_main

    return bench_perplexity_main(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bsub.add_parser("throughput", help="replay a synthetic trace: continuous vs static batching",
                        description="Replay a seeded synthetic trace (every request arriving at once) with "
                        "continuous batching, then with static batching on the same step model, and report "
                        "requests/s, output tokens/s, TTFT and TPOT (mean, p50, p99) of both.")
    spec_arg(t)
    weights_flag(t)
    t.add_argument("--num-requests", type=positive_int, default=256, help="requests in the trace (default 256)")
    t.add_argument("--input-len", default="100:1024", metavar="LO:HI", help="prompt lengths, uniform (100:1024)")
    t.add_argument("--output-len", default="100:1024", metavar="LO:HI", help="output lengths, uniform (100:1024)")
    seed_flag(t, help="seed of the trace and of random weights (default 0)")
    batch_limit_flags(t, max_num_seqs_help="running requests at most, and static batch size (default 64)")
    device_flag(t)
    dtype_flag(t)
    t.add_argument("--json", action="store_true", help="print the full result as JSON")
    quantize_flag(t)
    routers_flag(t)
    t.add_argument("--profile", metavar="FILE", help="profile the continuous run with cProfile; write the summary "
                   "(top functions by cumulative and own time) to FILE")
    engine_flags(t)
    t.set_defaults(func=model_paths_resolved(cmd_bench))

    qb = bsub.add_parser("quality", help="quantization schemes against the unquantized model",
                         description="Relative logit error and top-1 agreement of each quantization scheme "
                         "against the unquantized model, over the same evaluation tokens.")
    spec_arg(qb)
    weights_flag(qb, help=FULL_PRECISION_WEIGHTS_HELP)
    qb.add_argument("--schemes", metavar="A,B", help="schemes to compare (default: int8,int4-rtn-g128,"
                    "int4-gptq-g128, whose group becomes the largest that divides every K when 128 does not)")
    qb.add_argument("--positions", type=positive_int, default=256, help="evaluated positions (default 256)")
    qb.add_argument("--eval-text", metavar="FILE", help="text to evaluate on (default: seeded random tokens)")
    qb.add_argument("--calibration", metavar="FILE", help="calibration text for GPTQ (default: seeded random tokens)")
    device_flag(qb)
    dtype_flag(qb)
    qb.add_argument("--json", action="store_true", help="print the report as JSON")
    qb.set_defaults(func=model_paths_resolved(cmd_bench_quality))

    perplexity = add_perplexity_parser(bsub)  # its SPEC takes a checkpoint dir or a .gguf too, as the others'
    perplexity.set_defaults(func=model_paths_resolved(cmd_bench_perplexity))

    add_bench_serve_parser(bsub)
