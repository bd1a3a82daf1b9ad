"""Host work per engine step, with the model taken out: how much of a decode step is scheduler, step preparation,
sampling, detokenization and output objects (issue 9: less than the GPU step at 256 running sequences).

    python bench/host_step.py [--seqs 1 32 256] [--steps 200] [--prompt-len 512] [--vocab 32000] [--detokenize]
                              [--profile FILE] [--out-dir DIR]

The engine runs over a model that does no compute: it returns fixed fp32 logits [R, vocab] (a different argmax per
row, so every request keeps decoding) and writes no K/V. Everything else is kiln's own runtime on the CPU: the
scheduler, ModelRunner.prepare (staging buffers, block tables), the sampler on the logits, token bookkeeping, the
detokenizer (with --detokenize, kiln's byte-level tokenizer) and RequestOutputs. `--seqs` requests decode at once
(prompts of --prompt-len tokens, prefilled before timing); per step: median and p90 wall time, and with --profile a
cProfile summary of one run. On a GPU the sampler's tensor work runs on the device; here it runs on the CPU, so
a large --vocab overstates the host share (the default 32000 is a Llama-2 size; 128256 is Llama 3's).
Writes bench/results/host_step-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json

from kiln.runtime.engine import Engine
from kiln.runtime.sampler import SamplingParams
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

    def __post_init__(self) -> None:
        self.table = torch.randn(257, self.vocab, generator=torch.Generator().manual_seed(0))

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        rows = batch.positions.index_select(0, batch.sample_indices) % 257
        return self.table.index_select(0, rows)


@dataclass
class Limits:
    context: int = 4096


def run(num_seqs: int, steps: int, prompt_len: int, vocab: int, detokenize: bool, profile: bool) -> dict:
    model = NullModel(vocab)
    tok = ByteTokenizer(vocab) if detokenize else None
    per_seq = -(-(prompt_len + steps + 2) // model.block_size)
    engine = Engine(model, tok, Limits(), max_num_seqs=num_seqs, num_blocks=num_seqs * per_seq + 260,
                    max_num_batched_tokens=max(2048, prompt_len * num_seqs))
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(num_seqs):
        engine.add_request(prompt_token_ids=torch.randint(vocab, (prompt_len,), generator=g).tolist(), params=params)
    engine.step()  # the prefill of every prompt (the token budget covers them all)
    times = []
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == num_seqs, "every request decodes one token per step"
    if prof is not None:
        prof.disable()
    while engine.has_unfinished():
        engine.step()
    times.sort()
    row = {"seqs": num_seqs, "steps": steps, "prompt_len": prompt_len, "vocab": vocab, "detokenize": detokenize,
           "step_ms_median": round(statistics.median(times) * 1e3, 3),
           "step_ms_p90": round(times[int(0.9 * (len(times) - 1))] * 1e3, 3),
           "us_per_seq_per_step": round(statistics.median(times) / num_seqs * 1e6, 2)}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(30)
        row["profile"] = buf.getvalue()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--detokenize", action="store_true", help="detokenize outputs (byte-level tokenizer)")
    ap.add_argument("--profile", help="write a cProfile summary (top 30 by own time) of the largest --seqs run here")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the engine's host thread; the GPU machine's sampler work is not on the CPU
    rows = []
    for n in args.seqs:
        profile = bool(args.profile) and n == max(args.seqs)
        row = run(n, args.steps, args.prompt_len, args.vocab, args.detokenize, profile=profile)
        prof = row.pop("profile", None)
        if prof is not None:
            Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
            Path(args.profile).write_text(prof)
        print(row, file=sys.stderr)
        rows.append(row)
    result = {"bench": "host_step", **run_metadata(), "rows": rows}
    path = write_json(result_path(args.out_dir, "host_step"), result)
    print(f"wrote {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
