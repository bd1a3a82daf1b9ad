"""Mixture-of-Depths figures (issue 13): held-out perplexity against forward FLOPs per token.

    python bench/mod_routers.py distil  [--spec smollm2-135m] [--capacities 1.0 0.5 0.25 0.125] [--every 2]
                                        [--steps 0] [--decide threshold] [--eval-tokens 4096] [--init auto]
    python bench/mod_routers.py scratch [--capacities 0.5 0.25 0.125] [--every 2] [--steps 400]

distil: the routers of an existing model (default SmolLM2-135M-Instruct, the bundled GGUF dequantized to fp32)
are distilled from the dense model on bench/data/shakespeare-calibration.txt, every other weight frozen
(kiln.train.routers), then the held-out text bench/data/shakespeare-coriolanus.txt is scored in the causal form
kiln serves (threshold or predictor) and in the training form (top-k over each window), beside the dense model.
scratch: a small byte-level model and its routed twins trained from scratch on the same texts (kiln.train.scratch),
the paper's setting at CPU size. FLOPs per token (kiln.train.flops) use each routed layer's measured fraction of
tokens on the held-out text. Writes bench/results/mod-<mode>-<device>-<date>.json and a plot beside it (.svg).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json
from plot_svg import line_plot

from kiln.build import load_model
from kiln.cli.perplexity import window_nll
from kiln.ir.frontend import build_graph
from kiln.model_config import ModelConfig, NormConfig, RopeConfig
from kiln.spec.loader import load_spec
from kiln.train.flops import flops_per_token
from kiln.train.routers import RouterTraining, distil, routed_layers
from kiln.train.scratch import ScratchTraining, train_from_scratch

HERE = Path(__file__).resolve().parent
TRAIN_TEXT = HERE / "data" / "shakespeare-calibration.txt"
EVAL_TEXT = HERE / "data" / "shakespeare-coriolanus.txt"


def routed_fraction(gm: torch.fx.GraphModule, cfg: ModelConfig, ids: list[int], window: int) -> dict[int, float]:
    """Per routed layer, the fraction of the held-out tokens the causal form routes (read off the mask ops)."""
    counts: dict[int, list[float]] = {i: [0.0, 0.0] for i in routed_layers(cfg)}
    masks = {n.name: int(n.name.split("_")[1]) for n in gm.graph.nodes if n.name.endswith("router_mask")}
    assert sorted(masks.values()) == sorted(counts), f"mask nodes {masks} do not match the routed layers"
    hooks = torch.fx.Interpreter(gm)
    run_node = hooks.run_node

    def record(n):  # noqa: ANN001, ANN202
        out = run_node(n)
        if n.name in masks:
            counts[masks[n.name]][0] += float(out.sum())
            counts[masks[n.name]][1] += out.numel()
        return out

    hooks.run_node = record
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[lo : lo + window]])
            hooks.run(chunk, torch.arange(chunk.shape[1])[None])
    return {i: a / b for i, (a, b) in counts.items() if b}


def score(cfg: ModelConfig, weights: dict, ids: list[int], window: int, form: str) -> tuple[float, dict[int, float]]:
    gm = build_graph(cfg, weights, mod_form=form)
    nll, n = window_nll(gm, ids, window)
    frac = routed_fraction(gm, cfg, ids, window) if cfg.route is not None and form == "causal" else {}
    return math.exp(nll / n), frac


def row(cfg: ModelConfig, weights: dict, ids: list[int], window: int, extra: dict) -> dict:
    ppl, frac = score(cfg, weights, ids, window, "causal")
    out = {"capacity": cfg.route.capacity if cfg.route else None, "perplexity_causal": ppl,
           "routed_fraction": {str(k): v for k, v in frac.items()},
           "flops_per_token": flops_per_token(cfg, (window + 1) / 2, frac)}
    if cfg.route is not None:
        out["perplexity_training_form"] = score(cfg, weights, ids, window, "training")[0]
    return out | extra


def run_distil(args: argparse.Namespace) -> dict:
    m = load_model(args.spec, None, dtype="fp32", device="cpu", quantize="none")
    cfg, tok = m.model, m.tokenizer
    weights = {n: p.detach() for n, p in m.gm.named_parameters()}
    train_ids = tok.encode(TRAIN_TEXT.read_text())
    eval_ids = tok.encode(EVAL_TEXT.read_text())[: args.eval_tokens or None]
    rows = [row(cfg, weights, eval_ids, args.window, {"seconds": 0.0})]
    for c in args.capacities:
        t0 = time.perf_counter()
        opts = RouterTraining(capacity=c, every=args.every, decide=args.decide, steps=args.steps, batch=args.batch,
                              seq_len=args.seq_len, lr=args.lr, hidden=args.hidden, init=args.init,
                              calib_windows=args.calib_windows)
        res = distil(cfg, weights, train_ids, opts)
        extra = {"decide": args.decide, "init": args.init, "fit_correlation": res.fit_correlation,
                 "distil_kl_first": res.losses[0] if res.losses else None,
                 "distil_kl_last": sum(res.losses[-5:]) / max(len(res.losses[-5:]), 1),
                 "seconds": time.perf_counter() - t0}
        rows.append(row(res.cfg, {**weights, **res.tensors}, eval_ids, args.window, extra))
        print(f"capacity {c}: perplexity {rows[-1]['perplexity_causal']:.3f}", file=sys.stderr)
    return {"mode": "distil", "spec": args.spec, "train_text": TRAIN_TEXT.name, "eval_text": EVAL_TEXT.name,
            "train_tokens": len(train_ids), "eval_tokens": len(eval_ids), "window": args.window, "every": args.every,
            "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "init": args.init,
            "calib_windows": args.calib_windows, "rows": rows}


def scratch_config(every: int, capacity: float | None) -> ModelConfig:
    base = load_spec("tiny-llama").model
    cfg = dataclasses.replace(base, name="scratch-bytes", vocab=256, dim=128, layers=6, heads=4, kv_heads=2,
                              head_dim=32, ffn=384, context=256, norm=NormConfig("rms", 1e-5),
                              rope=RopeConfig(10000.0), tie_embeddings=True)
    if capacity is None:
        return cfg
    return dataclasses.replace(cfg, route=RouterTraining(capacity=capacity, every=every).mod())


def run_scratch(args: argparse.Namespace) -> dict:
    text = EVAL_TEXT.read_bytes()
    held = 8192
    train_ids = list(TRAIN_TEXT.read_bytes()) + list(text[:-held])
    eval_ids = list(text[-held:])[: args.eval_tokens]
    opts = ScratchTraining(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr)
    rows = []
    for c in [None, *args.capacities]:
        t0 = time.perf_counter()
        cfg = scratch_config(args.every, c)
        res = train_from_scratch(cfg, train_ids, opts)
        extra = {"train_loss_last": sum(res.losses[-10:]) / 10, "seconds": time.perf_counter() - t0}
        rows.append(row(cfg, res.weights, eval_ids, args.window, extra))
        print(f"capacity {c}: perplexity {rows[-1]['perplexity_causal']:.3f}", file=sys.stderr)
    return {"mode": "scratch", "model": dataclasses.asdict(scratch_config(args.every, None)) | {"body": "llama"},
            "train_bytes": len(train_ids), "eval_bytes": len(eval_ids), "window": args.window, "every": args.every,
            "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "rows": rows}


def draw(result: dict) -> str:
    """The plot: perplexity (log10 of it when the rows span more than 100x) against FLOPs per token / dense."""
    base = result["rows"][0]
    ppl = [r["perplexity_causal"] for r in result["rows"]]
    log = max(ppl) / min(ppl) > 100
    points = [(r["flops_per_token"] / base["flops_per_token"], math.log10(p) if log else p)
              for r, p in zip(result["rows"], ppl, strict=True)]
    return line_plot(points, [("dense" if r["capacity"] is None else f"c={r['capacity']:g}") for r in result["rows"]],
                     title=f"MoD ({result['mode']}): held-out perplexity vs FLOPs per token",
                     x_label="FLOPs per token / dense",
                     y_label="log10 perplexity (causal form)" if log else "perplexity (causal form)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("distil", "scratch"))
    ap.add_argument("--spec", default="smollm2-135m")
    ap.add_argument("--capacities", type=float, nargs="+", default=None)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--decide", choices=("threshold", "predictor"), default="threshold")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--init", choices=("auto", "fit", "flat"), default="auto",
                    help="distil: how the routers start (kiln.train.routers; auto: fitted below capacity 1)")
    ap.add_argument("--calib-windows", type=int, default=32, help="distil: windows for the fit and thresholds")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens scored (default: distil 4096, "
                    "scratch all 8192 bytes)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.mode == "distil":
        args.capacities = args.capacities or [1.0, 0.5, 0.25, 0.125]
        args.steps = 0 if args.steps is None else args.steps
        args.eval_tokens = args.eval_tokens or 4096
        result = run_distil(args)
    else:
        args.capacities = args.capacities or [0.5, 0.25, 0.125]
        args.steps = args.steps or 400
        result = run_scratch(args)
    result |= run_metadata(torch.device("cpu"))
    path = write_json(result_path(args.out_dir, f"mod-{args.mode}"), result)
    path.with_suffix(".svg").write_text(draw(result))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
