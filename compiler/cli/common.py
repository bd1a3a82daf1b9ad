"""Pieces the `kiln` subcommands share: the serving engine built from CLI flags, their help texts, flag value
types, and the `kiln` logger's stderr handler (checked and atomic file paths: kiln.cli.paths)."""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
from collections.abc import Callable

from kiln.errors import SpecError
from kiln.model_config import DTYPE_NAMES, KV_DTYPES, SpeculationConfig
from kiln.model_paths import resolve_model_paths
from kiln.runtime.sampling_params import SEED_MAX
from kiln.spec.speculation import OFF, parse_speculation

QUANTIZE_HELP = ("quantize weights: int8, or int4[-rtn|-gptq][-g32|-g64|-g128][-asym] "
                 "(overrides the spec's `quantize`)")
LOAD_QUANTIZE_HELP = (QUANTIZE_HELP[:-1] + "; with GGUF weights also gguf: keep its Q4_0 / Q4_1 / Q8_0 linears "
                      "quantized, on CPU too, or none: dequantize all)")
WEIGHTS_HELP = ("a Hugging Face checkpoint dir (config.json + *.safetensors), a .gguf file or a `kiln quantize` "
                "output (default: a bundled spec's packaged weights, e.g. smollm2-135m's, else seeded random weights)")
FULL_PRECISION_WEIGHTS_HELP = ("a Hugging Face checkpoint dir or a .gguf file (full precision or GGUF-quantized; "
                               "not a `kiln quantize` output; default: a bundled spec's packaged weights, else "
                               "seeded random weights)")
DEVICE_HELP = "auto (CUDA when present), cpu or cuda"
SPECULATION_HELP = ("speculative decoding: ngram(n = 3, k = 4), self(layers = L, k = 4) or draft(spec = \"...\", "
                    "weights = \"...\", k = 4), in the spec syntax; `off` overrides the spec's `speculation`")

EXIT_USER_ERROR = 2  # a KilnError: the message, no traceback (argparse's own flag errors exit 2 too)
EXIT_BUG = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away


def step_model(args: argparse.Namespace, m):
    """The compiled step model of a loaded model (kiln.compile.step; m.gm is rewritten in place).

    With speculation (--speculation, else the spec's key) it also prepares the drafter first, as args.draft_plan
    (the self drafter is cut from the Level-1 graph that compile_step rewrites); serving_engine builds it."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.compile.step import compile_step
    from kiln.speculation import prepare_drafter, resolve_speculation

    spec = resolve_speculation(getattr(args, "speculation", None), m, "--speculation")
    args.draft_plan = prepare_drafter(spec, m, seed=getattr(args, "seed", None) or 0) if spec is not None else None
    # Generated kernels on CUDA; on CPU the reference ops (Triton's interpreter is for testing codegen only).
    return compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=m.device.type == "cuda",
                        kv_cache_dtype=args.kv_cache_dtype)


def serving_engine(args: argparse.Namespace, m, step=None, **kw):
    """The serving engine over a loaded model (or an already compiled step model of it, from step_model), from the
    shared --num-blocks / --block-size / --speculation / --overlap-outputs / --async-scheduling ... flags
    (engine_flags)."""
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.runtime.engine import Engine
    from kiln.runtime.engine_setup import AsyncSchedulingError
    from kiln.runtime.kv_pool import PoolTooSmallError
    from kiln.speculation import build_drafter

    step = step_model(args, m) if step is None else step
    plan = getattr(args, "draft_plan", None)
    if plan is not None:  # only then: without speculation the engine is built exactly as before
        kw["drafter"] = build_drafter(plan, step)
    if getattr(args, "enable_prefix_caching", None) is not None:  # else the engine's default (on)
        kw.setdefault("enable_prefix_caching", args.enable_prefix_caching)
    try:
        return Engine(step, m.tokenizer, m.model, num_blocks=args.num_blocks, block_size=args.block_size,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      overlap_outputs=getattr(args, "overlap_outputs", None),
                      async_scheduling=getattr(args, "async_scheduling", None), **kw)
    except PoolTooSmallError as e:  # its fix in flags; --max-model-len only where the command has it (serve)
        shorten = "lower --max-model-len" if hasattr(args, "max_model_len") else None
        raise e.advised("--num-blocks", "--gpu-memory-utilization", shorten) from None
    except AsyncSchedulingError as e:  # in flags, not in Engine's argument names
        raise e.advised("--async-scheduling", "--overlap-outputs", "--no-overlap-outputs", ASYNC_FIX[e.conflict]) \
            from None


# AsyncSchedulingError's fix in flags, by what --async-scheduling met
ASYNC_FIX = {"speculation": "drop --async-scheduling (or give --no-async-scheduling), or turn speculation off with "
                            "--speculation off",
             "overlap_outputs": "drop --async-scheduling or --no-overlap-outputs"}


def dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPE_NAMES, metavar="DTYPE",
                   help="override the spec's compile dtype: fp32, fp16 or bf16, or vLLM's names (float32, float, "
                   "float16, half, bfloat16, and auto: the spec's dtype, or a checkpoint's own config.json "
                   "torch_dtype when there is no spec; without --dtype: the spec's, else fp32)")


def generation_config_flag(p: argparse.ArgumentParser) -> None:
    """vLLM's --generation-config: where default sampling parameters come from (kiln.build.load_model)."""
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters for the flags not given: auto (the default, as in vLLM): the "
                   "checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                   "max_new_tokens); vllm: kiln's own; or a directory holding a generation_config.json")


def chat_template_flag(p: argparse.ArgumentParser) -> None:
    """vLLM's --chat-template: a file, or the template's text (kiln.chat_template.chat_template_arg)."""
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="the chat template to use instead of the model's: a Jinja file, or the template's text")


# ---- the flags several commands share: one definition each, so their types and defaults cannot drift apart
# (tests/cli/test_cli_shared_flags.py checks every subcommand). A command passes help= (or default=) only where its
# meaning truly differs.


def device_flag(p: argparse.ArgumentParser, default: str = "auto", help: str = DEVICE_HELP) -> None:
    p.add_argument("--device", default=default, help=help)


# SPEC of every command that loads a model through model_paths_resolved (a checkpoint or a .gguf given as the spec
# is its weights)
SPEC_HELP = ("a .kiln file or bundled spec name, or a Hugging Face checkpoint dir or a .gguf file, as --weights "
             "(default: from --weights, else the bundled tiny-llama with seeded random weights)")


def spec_arg(p: argparse.ArgumentParser, help: str = SPEC_HELP) -> None:
    """The optional SPEC positional of a command wrapped in model_paths_resolved."""
    p.add_argument("spec", metavar="SPEC", nargs="?", help=help)


def weights_flag(p: argparse.ArgumentParser, help: str = WEIGHTS_HELP, metavar: str = "PATH") -> None:
    p.add_argument("--weights", metavar=metavar, help=help)


def seed_flag(p: argparse.ArgumentParser, help: str, default: int | None = 0) -> None:
    """--seed, of seed_arg's range: default 0, or None where "not given" means something (kiln run's sampling)."""
    p.add_argument("--seed", type=seed_arg, default=default, help=help)


def quantize_flag(p: argparse.ArgumentParser, help: str = LOAD_QUANTIZE_HELP, required: bool = False) -> None:
    p.add_argument("--quantize", metavar="SCHEME", required=required, help=help)


def batch_limit_flags(p: argparse.ArgumentParser,
                      max_num_seqs_help: str = "running requests at most (default 64)") -> None:
    """vLLM's --max-num-seqs / --max-num-batched-tokens: the engine's batch limits, for the commands that batch
    many requests (serve, bench throughput; kiln run's single request takes max_num_seqs=1, so engine_flags
    leaves these out)."""
    p.add_argument("--max-num-seqs", type=int, default=64, help=max_num_seqs_help)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most (2048)")


def model_paths_resolved(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command whose SPEC positional may name a checkpoint directory or a .gguf file, the vLLM way: before it
    runs, args.spec / args.weights are set as if that were given as --weights (kiln.build.resolve_model_paths),
    so that what the command checks before loading sees the weights too."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        args.spec, args.weights = resolve_model_paths(args.spec, args.weights)
        return func(args)

    return run


def routers_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routers", metavar="FILE", help="Mixture-of-Depths routers from `kiln train-router` to attach "
                   "to the dense model (the routing is in the file; --quantize then covers the routed model)")


def engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: from free GPU memory, or a CPU default)")
    p.add_argument("--block-size", type=int, help="tokens per KV cache block (default: the spec's "
                   "kv_cache = paged(block = N), else 16)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, help="KV cache element type: auto (the model "
                   "dtype) or int8 with per-token, per-head scales (default: the spec's kv_cache dtype, else auto)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the weights and KV cache may use (default 0.9)")
    p.add_argument("--speculation", type=speculation_arg, metavar="DRAFTER", help=SPECULATION_HELP)
    p.add_argument("--overlap-outputs", action=argparse.BooleanOptionalAction, default=None,
                   help="make each step's outputs (detokenization, output objects) while the next step's model "
                   "call runs; each output then comes one step later (default: on for CUDA, off elsewhere)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each decode step before the last one's sampled ids reach the host "
                   "(implies --overlap-outputs; default: on for CUDA without speculation)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV blocks of a common prompt prefix between requests (default: on, as in vLLM)")


# ---- flag values -----------------------------------------------------------------------------------------

# --seed takes SamplingParams' seed range (SEED_MAX); it also seeds random weights through a torch.Generator, which
# takes any unsigned 64-bit seed too.


def seed_arg(text: str) -> int:
    """argparse type of --seed: an integer in 0 .. 2**64 - 1 (it seeds sampling and random weights)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= seed <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1 ({SEED_MAX}), got {text}")
    return seed


def speculation_arg(text: str) -> SpeculationConfig | str:
    """argparse type of --speculation: a drafter in the spec syntax, checked now (errors point into the flag's
    text), or "off"."""
    try:
        cfg = parse_speculation(text, "--speculation")
    except SpecError as e:
        raise argparse.ArgumentTypeError(f"\n{e}") from None
    return OFF if cfg is None else cfg


def at_least(lo: int):
    """argparse type of a count flag: a whole number >= lo."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        return value

    return parse


positive_int = at_least(1)

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """argparse type of a token count written as vLLM writes --max-model-len: a whole number, or one with a suffix,
    k / m / g / t decimal (4k = 4000, 25.6k = 25600) and K / M / G / T binary (32K = 32768, whole numbers only)."""
    value = text.strip()
    m = _HUMAN_INT.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                             f"{number}{suffix.lower()} (decimal)?")
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, optionally with a k / m / g (x1000) or K / M / G "
                                         f"(x1024) suffix such as 4k or 32K, got {text!r}") from None


# ---- logging ---------------------------------------------------------------------------------------------


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (tests and callers swap it), as `kiln: message`."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("kiln: %(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(debug: bool = False) -> None:
    """Route the `kiln` logger's diagnostics (cache repairs, ...) to stderr; --debug adds info messages."""
    logger = logging.getLogger("kiln")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO if debug else logging.WARNING)
