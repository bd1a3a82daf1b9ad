"""`kiln train-router`: distil Mixture-of-Depths routers into a dense model and save them (kiln.train.routers)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from kiln.cli.common import check_input_file, check_output_file


def _capacity(text: str) -> float:
    try:
        c = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < c <= 1:
        raise argparse.ArgumentTypeError(f"{c} is out of range; allowed: 0 < capacity <= 1 (e.g. 0.125)")
    return c


def cmd_train_router(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say
    from kiln.cli.perplexity import window_nll
    from kiln.ir.frontend import build_graph
    from kiln.train.flops import flops_per_token
    from kiln.train.router_files import save_routers
    from kiln.train.routers import RouterTraining, distil

    check_input_file("--text", args.text)
    check_input_file("--eval-text", args.eval_text)
    out = check_output_file("-o", args.output)
    opts = RouterTraining(capacity=args.capacity, every=args.every, decide=args.decide, hidden=args.hidden,
                          steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                          init=args.init, calib_windows=args.calib_windows)
    opts.mod()  # bad settings fail before the model loads
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype="fp32", device=args.device)  # a GGUF is dequantized off CUDA
    weights = {n: p.detach() for n, p in m.gm.named_parameters()}
    ids = m.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    say(f"distilling routers into {m.model.name} (capacity {args.capacity}, every {args.every}, decide "
        f"{args.decide}) on {len(ids)} tokens of {args.text}")
    res = distil(m.model, weights, ids, opts)
    save_routers(out, res.cfg, res.tensors)
    fractions = ", ".join(f"layer {i}: {f:.2f}" for i, f in res.routed_fraction.items())
    say(f"wrote {out} in {time.perf_counter() - t0:.0f}s; tokens routed on the training text (causal form): "
        f"{fractions}")
    if args.eval_text:
        eval_ids = m.tokenizer.encode(Path(args.eval_text).read_text(encoding="utf-8"))[: args.eval_tokens]
        window = min(args.seq_len, m.model.context)
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
    p.add_argument("--weights", metavar="PATH", help="its checkpoint (dir or .gguf; default: the spec's bundled or "
                   "seeded random weights)")
    p.add_argument("--text", metavar="FILE", required=True, help="training text (UTF-8)")
    p.add_argument("--eval-text", metavar="FILE", help="held-out text: report dense and routed perplexity on it")
    p.add_argument("--eval-tokens", type=int, default=4096, help="tokens of --eval-text scored (default 4096)")
    p.add_argument("--capacity", type=_capacity, required=True, help="fraction of tokens a routed layer takes")
    p.add_argument("--every", type=int, default=2, help="route layers i with (i + 1) %% every == 0 (default 2)")
    p.add_argument("--decide", choices=("threshold", "predictor"), default="threshold",
                   help="how generation decides per token (default threshold)")
    p.add_argument("--hidden", type=int, default=128, help="predictor width (decide = predictor)")
    p.add_argument("--init", choices=("auto", "fit", "flat"), default="auto",
                   help="how the routers start: fit (to the tokens the dense model attends to most), flat (every "
                   "score 1), auto (default: fit below capacity 1)")
    p.add_argument("--calib-windows", type=int, default=32,
                   help="windows of --seq-len tokens for the fit and the thresholds (default 32)")
    p.add_argument("--steps", type=int, default=0,
                   help="KL-distillation steps after the start (default 0: the fit alone; see README, MoD figures)")
    p.add_argument("--batch", type=int, default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per window (default 256; fit and score on the context length you serve)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="routers file to write (.safetensors)")
    p.set_defaults(func=cmd_train_router)
