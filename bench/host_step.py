"""Host work per engine step, with the model taken out: how much of a decode step is scheduler, step preparation,
sampling, detokenization and output objects (issue 9: less than the GPU step at 256 running sequences).

    python bench/host_step.py [--seqs 1 32 256] [--steps 200] [--prompt-len 512] [--vocab 32000] [--detokenize]
                              [--spec NAME [--capacity C --every E]] [--repeat N] [--tag TAG] [--profile FILE]
                              [--output-kind cumulative|delta|final_only] [--out-dir DIR]

The engine runs over a model that does no compute: it returns fixed fp32 logits [R, vocab] (a different argmax per
row, so every request keeps decoding) and writes no K/V. Everything else is kiln's own runtime on the CPU: the
scheduler, ModelRunner.prepare (staging buffers, block tables), the sampler on the logits, token bookkeeping, the
detokenizer (with --detokenize, kiln's byte-level tokenizer) and RequestOutputs. `--seqs` requests decode at once
(prompts of --prompt-len tokens, prefilled before timing); per step: median and p90 wall time, and with --profile a
cProfile summary of a third, untimed run (overlap off: all of the host work). On a GPU the sampler's tensor work runs
on the device; here it runs on the CPU, so a large --vocab overstates the host share (the default 32000 is a Llama-2
size; 128256 is Llama 3's).

Each size runs twice: Engine(overlap_outputs=False), and True, where a step makes the previous step's outputs
(detokenization, RequestOutputs) after launching its model call and before reading its sampled ids back. Here the
model call is synchronous, so the overlap hides nothing: the figures for it are the step's total host time, the
output work inside it (which a GPU step runs beside), and the rest, the critical path a GPU step cannot hide
(`overlap_critical_ms_median`: what must stay below the GPU step).

A Mixture-of-Depths model's step does more host work: routed lengths and tables in prepare(), the routed flags
recorded after the step, a reservation per routed layer in the block manager. `--spec NAME` (a bundled spec or a
.kiln path; `--capacity` and `--every` route a dense one, as bench/mod_speed.py does) takes the spec's layer
counts: the null model then has its dense layers and, for a routed spec, its routed layers, and returns the routed
flags a router would, from a fixed pattern (each row routed in layer j with probability `capacity`, drawn once per
(position, row) from a seeded table, so sequences differ and every run routes the same). Every size then runs the
spec's dense twin (the same layers unrouted) and the routed model side by side, and `routed_over_dense` is the
ratio of their step times (with `--repeat N` each size runs N times, the models alternating, and every figure is
the median over the runs: the CPU figures move with a shared machine's load). The KV pools stay tiny (one kv head
of 8): the host work does not depend on them.
Writes bench/results/host_step-<device>-<date>.json, or for a routed spec host_step-routed[-TAG]-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json

from kiln.model_config import ModConfig
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import OUTPUT_KINDS, SamplingParams
from kiln.spec.loader import load_spec
from kiln.step import KVCache, StepBatch
from kiln.tokenizer import ByteTokenizer

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class NullModel:
    """A StepModel that computes nothing: logits from a fixed table, indexed by position so tokens vary."""

    vocab: int
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 8
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    block_size: int = 16
    num_routed_layers: int = 0  # > 0: a Mixture-of-Depths model, which also returns routed flags [layers, N]
    routed_capacity: float = 1.0  # the chance that a routed layer routes a row

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(257, self.vocab, generator=g)
        self.route_table = (torch.rand(self.num_routed_layers, ROUTE_PERIOD, generator=g)
                            < self.routed_capacity).to(torch.int32)

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        rows = batch.positions.index_select(0, batch.sample_indices) % 257
        logits = self.table.index_select(0, rows)
        if not self.num_routed_layers:
            return logits
        # Position and row (a sequence's place in the batch) pick the pattern's column: sequences decoding the
        # same position route differently, and each routes about `capacity` of its tokens in each layer.
        n = batch.positions.shape[0]
        cols = (batch.positions + 131 * torch.arange(n)) % ROUTE_PERIOD
        return logits, self.route_table.index_select(1, cols)


ROUTE_PERIOD = 1009  # a prime: the pattern's columns


class TimedEngine(Engine):
    """The engine, clocking its output work (OutputMaker.emit; with overlap_outputs, what runs beside the next
    model call)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.output_s = 0.0
        emit = self.output.emit

        def timed_emit(made):
            t = time.perf_counter()
            try:
                return emit(made)
            finally:
                self.output_s += time.perf_counter() - t

        self.output.emit = timed_emit


@dataclass
class Limits:
    context: int = 4096


@dataclass(frozen=True)
class Shape:
    """What of a spec the null model takes: its dense and routed layer counts and the routed capacity."""

    name: str = "null"
    num_layers: int = 1
    num_routed_layers: int = 0
    capacity: float = 1.0
    every: int = 0

    def dense_twin(self) -> Shape:
        return Shape(self.name, self.num_layers + self.num_routed_layers)


def spec_shape(spec: str, capacity: float | None, every: int | None) -> Shape:
    """The layer counts of a spec (routed by capacity / every when given, as bench/mod_speed.py routes)."""
    cfg = load_spec(spec).model
    route = cfg.route
    if capacity is not None or every is not None:
        base = route or ModConfig(1.0)
        route = ModConfig(base.capacity if capacity is None else capacity, base.every if every is None else every)
        if not 0 < route.capacity <= 1 or route.every < 1:
            raise SystemExit("need 0 < --capacity <= 1 and --every >= 1")
    routed = sum(route.routed(i) for i in range(cfg.layers)) if route else 0
    name = Path(spec).name.removesuffix(".kiln")
    if not routed:
        return Shape(name, cfg.layers)
    return Shape(name, cfg.layers - routed, routed, route.capacity, route.every)


def run(num_seqs: int, steps: int, prompt_len: int, vocab: int, detokenize: bool, profile: bool,
        overlap: bool = False, shape: Shape = Shape(), output_kind: str = "cumulative") -> dict:
    model = NullModel(vocab, num_layers=shape.num_layers, num_routed_layers=shape.num_routed_layers,
                      routed_capacity=shape.capacity)
    tok = ByteTokenizer(vocab) if detokenize else None
    per_seq = -(-(prompt_len + steps + 2) // model.block_size)
    blocks = num_seqs * per_seq + 260
    # A routed layer reserves its worst case (every token of the prefill routed) before the step: pools as large
    # as the dense one, as in bench/mod_speed.py.
    engine = TimedEngine(model, tok, Limits(), max_num_seqs=num_seqs, num_blocks=blocks,
                         max_num_batched_tokens=max(2048, prompt_len * num_seqs), overlap_outputs=overlap,
                         routed_num_blocks=blocks if shape.num_routed_layers else None)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True, output_kind=output_kind)
    g = torch.Generator().manual_seed(1)
    for _ in range(num_seqs):
        engine.add_request(prompt_token_ids=torch.randint(vocab, (prompt_len,), generator=g).tolist(), params=params)
    engine.step()  # the prefill of every prompt (the token budget covers them all)
    times, output = [], []
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        before = engine.output_s
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        output.append(engine.output_s - before)
        # every request decodes one token per step (and ends after the timed steps)
        assert len(outs) == (0 if output_kind == "final_only" else num_seqs)
    if prof is not None:
        prof.disable()
    t = time.perf_counter()
    while engine.has_unfinished():  # the last two tokens, the final outputs (with final_only, all the text)
        engine.step()
    drain = time.perf_counter() - t
    critical = [t - o for t, o in zip(times, output, strict=True)]
    row = {"step_ms_median": ms(statistics.median(times)), "step_ms_p90": ms(p90(times)),
           # every step of the run and the drain, per timed step: what final_only moves to the end is counted
           "all_ms_per_step": ms((sum(times) + drain) / steps),
           "output_ms_median": ms(statistics.median(output)), "critical_ms_median": ms(statistics.median(critical)),
           "us_per_seq_per_step": round(statistics.median(times) / num_seqs * 1e6, 2)}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(30)
        row["profile"] = buf.getvalue()
    return row


def _median(rows) -> dict:
    """Each figure's median over runs of the same size and model."""
    rows = list(rows)
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0] if k != "profile"}


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--detokenize", action="store_true", help="detokenize outputs (byte-level tokenizer)")
    ap.add_argument("--spec", help="take the layer counts (and routing) of this spec: a bundled name or a .kiln path "
                                   "(default: one dense layer)")
    ap.add_argument("--capacity", type=float, help="route the spec: the share of tokens a routed layer takes")
    ap.add_argument("--every", type=int, help="route the spec: every n-th layer is routed")
    ap.add_argument("--repeat", type=int, default=1, help="run each size this many times, the models alternating; "
                                                          "report the median of each figure")
    ap.add_argument("--tag", help="a word for the result file's name (host_step-routed-TAG-...), e.g. before")
    ap.add_argument("--profile", help="write a cProfile summary (top 30 by own time) of the largest --seqs run here "
                                      "(the routed model's, for a routed spec)")
    ap.add_argument("--output-kind", default="cumulative", choices=OUTPUT_KINDS,
                    help="the requests' SamplingParams.output_kind (LLM.generate asks for final_only, the server "
                         "for delta)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.spec is None and (args.capacity is not None or args.every is not None):
        raise SystemExit("--capacity and --every route a spec: give --spec too")
    shape = spec_shape(args.spec, args.capacity, args.every) if args.spec else Shape()
    models = [("dense", shape.dense_twin()), ("routed", shape)] if shape.num_routed_layers else [("dense", shape)]
    torch.set_num_threads(1)  # the engine's host thread; the GPU machine's sampler work is not on the CPU
    rows = []
    load_before = os.getloadavg()[0]  # a shared machine's other work shows up in every figure
    for n in args.seqs:
        runs: dict[str, list[tuple[dict, dict]]] = {kind: [] for kind, _ in models}
        for _ in range(args.repeat):  # the models alternate, so a change in the machine's load hits them alike
            for kind, sh in models:
                common = dict(shape=sh, output_kind=args.output_kind)
                runs[kind].append((run(n, args.steps, args.prompt_len, args.vocab, args.detokenize, profile=False,
                                       **common),
                                   run(n, args.steps, args.prompt_len, args.vocab, args.detokenize, profile=False,
                                       overlap=True, **common)))
        for kind, sh in models:
            profile = bool(args.profile) and n == max(args.seqs) and sh is models[-1][1]
            off, on = (_median(r[i] for r in runs[kind]) for i in (0, 1))
            if profile:  # a run of its own: cProfile's overhead would inflate the timed ones
                prof = run(n, args.steps, args.prompt_len, args.vocab, args.detokenize, profile=True,
                           shape=sh, output_kind=args.output_kind)["profile"]
                Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
                Path(args.profile).write_text(prof)
            row = {"seqs": n, "steps": args.steps, "prompt_len": args.prompt_len, "vocab": args.vocab,
                   "detokenize": args.detokenize, "output_kind": args.output_kind,
                   "step_ms_median": off["step_ms_median"], "step_ms_p90": off["step_ms_p90"],
                   "output_ms_median": off["output_ms_median"], "all_ms_per_step": off["all_ms_per_step"],
                   "us_per_seq_per_step": off["us_per_seq_per_step"],
                   **{f"overlap_{k}": v for k, v in on.items() if k != "us_per_seq_per_step"},
                   "model": kind, "layers": sh.num_layers, "routed_layers": sh.num_routed_layers}
            if args.repeat > 1:  # each figure above is the median over the repeats; these are the repeats
                row["repeats"] = {"step_ms_median": [r[0]["step_ms_median"] for r in runs[kind]],
                                  "overlap_critical_ms_median": [r[1]["critical_ms_median"] for r in runs[kind]]}
            if kind == "routed":
                dense = rows[-1]
                row["routed_over_dense"] = {k: round(row[k] / dense[k], 3) for k in
                                            ("step_ms_median", "overlap_critical_ms_median")}
            print(row, file=sys.stderr)
            rows.append(row)
    note = ("the model call is synchronous here (no device), so overlap_outputs hides nothing: overlap_step_ms is "
            "all the host work; on a GPU overlap_output_ms runs beside the model call and overlap_critical_ms is "
            "what a step cannot hide")
    result = {"bench": "host_step", **run_metadata(), "note": note, "spec": shape.name,
              "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    if shape.num_routed_layers:
        result |= {"capacity": shape.capacity, "every": shape.every, "route_pattern":
                   "row i of a step routed in layer j when a seeded table says so at column "
                   f"(position + 131 i) mod {ROUTE_PERIOD}, each entry 1 with probability capacity"}
    name = "host_step" + ("-routed" if shape.num_routed_layers else "") + (f"-{args.tag}" if args.tag else "")
    path = write_json(result_path(args.out_dir, name), result)
    print(f"wrote {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
