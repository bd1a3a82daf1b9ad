"""`kiln train-router`: distil Mixture-of-Depths routers into a dense model and save them (kiln.train.routers)."""

from __future__ import annotations

import argparse
import math
import time

from kiln.cli.common import at_least, device_flag, model_paths_resolved, seed_flag, weights_flag
from kiln.cli.paths import check_output_file, staged_file
from kiln.cli.text_input import read_text_file
from kiln.errors import UsageError
from kiln.train.flops import flops_per_token

DEFAULT_SEQ_LEN = 256  # tokens per window, or the model's context when that is shorter
DEFAULT_HIDDEN = 128  # the predictor's width (--decide predictor)


def _capacity(text: str) -> float:
    try:
        c = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < c <= 1:
        raise argparse.ArgumentTypeError(f"{c} is out of range; allowed: 0 < capacity <= 1 (e.g. 0.125)")
    return c


def _learning_rate(text: str) -> float:
    try:
        lr = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < lr < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number (e.g. 3e-3), got {text}")
    return lr


def cmd_train_router(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import describe_model, load_model, say
    from kiln.cli.perplexity import check_full_precision, fit_window, window_nll
    from kiln.ir.frontend import build_graph
    from kiln.train.router_files import save_routers
    from kiln.train.routers import RouterTraining, distil

    # Every input is checked before the model loads, so nothing fails after the routers file is written.
    text = read_text_file("--text", args.text)
    eval_text = read_text_file("--eval-text", args.eval_text) if args.eval_text else None
    out = check_output_file("-o", args.output, example="routers.safetensors")
    check_full_precision(args.weights, "train-router")  # it distils from the dense model's own weights
    cfg = describe_model(args.spec, args.weights)
    if args.every > cfg.layers:
        raise UsageError(f"--every {args.every}: routes layers i with (i + 1) % every == 0, none of {cfg.name}'s "
                         f"{cfg.layers}; give 1 to {cfg.layers}")
    seq_len, note = fit_window(args.seq_len, cfg.context, "--seq-len", DEFAULT_SEQ_LEN)
    if note:
        say(f"note: {note}")
    if args.hidden is not None and args.decide != "predictor":
        raise UsageError(f"--hidden {args.hidden} sets the width of a predictor, which --decide {args.decide} has none "
                         "of; add --decide predictor, or leave --hidden out")
    hidden = args.hidden if args.hidden is not None else DEFAULT_HIDDEN
    opts = RouterTraining(capacity=args.capacity, every=args.every, decide=args.decide, hidden=hidden,
                          steps=args.steps, batch=args.batch, seq_len=seq_len, lr=args.lr, seed=args.seed,
                          init=args.init, calib_windows=args.calib_windows)
    opts.mod()  # bad settings fail before the model loads
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype="fp32", device=args.device)  # a GGUF is dequantized off CUDA
    weights = {n: p.detach() for n, p in m.gm.named_parameters()}
    ids = m.tokenizer.encode(text)
    if len(ids) < seq_len + 1:
        raise UsageError(f"--text {args.text}: {len(ids)} tokens; training needs at least --seq-len + 1 = "
                         f"{seq_len + 1}: give a longer text or a smaller --seq-len")
    eval_ids = m.tokenizer.encode(eval_text)[: args.eval_tokens] if eval_text is not None else None
    if eval_ids is not None and len(eval_ids) < 2:
        raise UsageError(f"--eval-text {args.eval_text}: {len(eval_ids)} token(s); perplexity needs at least 2: give "
                         "a longer text")
    say(f"distilling routers into {m.model.name} (capacity {args.capacity}, every {args.every}, decide "
        f"{args.decide}) on {len(ids)} tokens of {args.text}")
    res = distil(m.model, weights, ids, opts)
    with staged_file("-o", out) as stage:  # whole or not at all, readable as any file the user makes
        save_routers(stage, res.cfg, res.tensors)
    fractions = ", ".join(f"layer {i}: {f:.2f}" for i, f in res.routed_fraction.items())
    say(f"wrote {out} in {time.perf_counter() - t0:.0f}s; tokens routed on the training text (causal form): "
        f"{fractions}")
    if eval_ids is not None:
        window = seq_len
        for name, cfg, gm in (("dense", m.model, m.gm),
                              ("routed", res.cfg, build_graph(res.cfg, {**weights, **res.tensors}))):
            nll, n = window_nll(gm, eval_ids, window)
            flops = flops_per_token(cfg, (window + 1) / 2, res.routed_fraction if cfg.route else None)
            print(f"{name}: perplexity {math.exp(nll / n):.3f} over {n} tokens of {args.eval_text}, "
                  f"{flops / 1e6:.1f} MFLOP per token (routed fractions from the training text)")
    return 0


def add_train_router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-router", help="distil Mixture-of-Depths routers into a dense model",
                       description="Train the routers (and predictors) of a dense model routed as asked, by "
                       "distillation from the dense model on a text; every other weight stays frozen. Writes the "
                       "router tensors to a safetensors file whose metadata records the routing.")
    p.add_argument("spec", metavar="SPEC", nargs="?", help="a dense .kiln file or bundled spec name")
    weights_flag(p, help="its checkpoint (dir or .gguf, not a `kiln quantize` output; "
                 "default: the spec's bundled or seeded random weights)")
    p.add_argument("--text", metavar="FILE", required=True, help="training text (UTF-8)")
    p.add_argument("--eval-text", metavar="FILE", help="held-out text: report dense and routed perplexity on it")
    p.add_argument("--eval-tokens", type=at_least(2), default=4096,
                   help="tokens of --eval-text scored (default 4096)")
    p.add_argument("--capacity", type=_capacity, required=True, help="fraction of tokens a routed layer takes")
    p.add_argument("--every", type=at_least(1), default=2,
                   help="route layers i with (i + 1) %% every == 0 (default 2)")
    p.add_argument("--decide", choices=("threshold", "predictor"), default="threshold",
                   help="how generation decides per token (default threshold)")
    p.add_argument("--hidden", type=at_least(1), help=f"predictor width, with --decide predictor (default "
                   f"{DEFAULT_HIDDEN})")
    p.add_argument("--init", choices=("auto", "fit", "flat"), default="auto",
                   help="how the routers start: fit (to the tokens the dense model attends to most), flat (every "
                   "score 1), auto (default: fit below capacity 1)")
    p.add_argument("--calib-windows", type=at_least(1), default=32,
                   help="windows of --seq-len tokens for the fit and the thresholds (default 32)")
    p.add_argument("--steps", type=at_least(0), default=0,
                   help="KL-distillation steps after the start (default 0: the fit alone; see README, MoD figures)")
    p.add_argument("--batch", type=at_least(1), default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=int,
                   help=f"tokens per window, 2 to the model's context (default {DEFAULT_SEQ_LEN}, or the context when "
                   "shorter; fit and score on the context length you serve)")
    p.add_argument("--lr", type=_learning_rate, default=3e-3, help="learning rate of the distillation steps")
    seed_flag(p, help="seed of the initial routers and of the training batches (default 0)")
    # cpu, not auto: training is deliberate about where it runs (and a GGUF is dequantized off CUDA)
    device_flag(p, default="cpu", help="cpu (default) or cuda")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="routers file to write (.safetensors)")
    p.set_defaults(func=model_paths_resolved(cmd_train_router))
