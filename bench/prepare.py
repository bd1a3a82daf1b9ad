"""Step-preparation benchmark: ModelRunner.prepare() on the host, for decode batches of 1..256 sequences, with
max_model_len 2048 and 131072, against the list-building version it replaced (issue 9).

    python bench/prepare.py [--batches 1 2 4 ... 256] [--context 1000] [--reps 20] [--no-legacy]

Every sequence has `context` tokens in the cache and decodes one token; the batch is padded to a CUDA-graph
size (pad_decode_batches), the case whose cost used to grow with max_model_len. Runs on the CPU (prepare is
host work; with no device copy). Prints microseconds per prepare() and writes
bench/results/prepare-<device>-<date>.json (--out-dir to change where; metadata from bench_meta.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json
from legacy_prepare import legacy_prepare, legacy_tensors

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.schedule import Schedule, ScheduledSeq

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


class _HostOnlyModel:
    """Just what ModelRunner needs to build batches (a one-value KV cache); prepare() never calls it."""

    num_layers, num_kv_heads, head_dim, vocab = 1, 1, 1, 32
    dtype = kv_dtype = torch.float16
    device = torch.device("cpu")


def _runner(batch: int, context: int, max_model_len: int) -> tuple[ModelRunner, Schedule]:
    blocks = -(-(context + 1) // BLOCK)
    bm = BlockManager(batch * blocks + 1, BLOCK, enable_prefix_caching=False)
    runner = ModelRunner(_HostOnlyModel(), bm, max_num_seqs=max(batch, 1), max_model_len=max_model_len,
                         pad_decode_batches=True)
    sched = Schedule()
    for i in range(batch):
        req = Request(str(i), None, [1] * context, SamplingParams(max_tokens=1), Detokenizer(None))
        bm.append_slots(req.request_id, context + 1)
        sched.seqs.append(ScheduledSeq(req, context - 1, 1, True))  # decodes the prompt's last token
    return runner, sched


def _legacy(runner: ModelRunner, sched: Schedule) -> None:
    legacy_tensors(legacy_prepare(runner, sched)[0])


def _time(fn, reps: int) -> float:
    fn()  # the first call allocates buffers and rows
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--max-model-lens", type=int, nargs="+", default=[2048, 131072])
    ap.add_argument("--context", type=int, default=1000, help="tokens in the cache per sequence")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-legacy", action="store_true", help="skip timing the old list-building prepare")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in args.batches:
        for mml in args.max_model_lens:
            if args.context >= mml:
                raise SystemExit(f"--context {args.context} must be below every max_model_len ({mml})")
            runner, sched = _runner(batch, args.context, mml)
            us = _time(lambda: runner.prepare(sched), args.reps)  # noqa: B023 (timed right here)
            legacy = None if args.no_legacy else _time(partial(_legacy, runner, sched), max(3, args.reps // 5))
            rows.append({"batch": batch, "max_model_len": mml, "prepare_us": round(us, 1),
                         "legacy_prepare_us": None if legacy is None else round(legacy, 1)})
            print(f"batch {batch:4d}  max_model_len {mml:7d}  prepare {us:9.1f} us"
                  + ("" if legacy is None else f"  legacy {legacy:10.1f} us"), file=sys.stderr)
    ratio = [a["prepare_us"] / b["prepare_us"] for a, b in zip(rows[1::2], rows[::2], strict=True)] \
        if args.max_model_lens == [2048, 131072] else []
    result = {"bench": "prepare", **run_metadata(), "context": args.context, "block_size": BLOCK,
              "reps": args.reps, "rows": rows,
              "max_ratio_131072_over_2048": round(max(ratio), 2) if ratio else None}  # fmt: skip
    print(f"wrote {write_json(result_path(args.out_dir, 'prepare'), result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
