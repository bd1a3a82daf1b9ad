"""How much of the engine's host work a device step hides, on a simulated device: synchronous steps,
overlap_outputs, and async scheduling side by side (issue 9: host work off the critical path).

    python bench/pipeline_sim.py [--seqs 1 32 256] [--device-ms 1.46] [--steps 200] [--prompt-len 512]
                                 [--vocab 256] [--detokenize] [--out-dir DIR]

There is no GPU here, so the device is simulated: the model (bench/host_step.py's NullModel: fixed logits, no
compute, no K/V) queues --device-ms of work on a device clock at every call, as a CUDA launch would (the clock runs
from when the last queued step ends, or now if the device is idle), and the sampler's one device -> host copy
(LaunchedSample.result) spins until the step it reads has finished, as a CUDA copy waits for its stream. Everything
else is kiln's engine on the CPU. A step then takes host work + device time when the two are serial, and about the
larger of them when the host works while the device runs. Per mode and batch size: ms per decode step (median),
output tok/s, the host's waits for the device, the device's idle share (1 - device time / step time) and how
many of the timed steps were launched onto an idle device.

The default device time, 1.46 ms, is the gpt-fast-style batch-1 decode step of Llama-3.2-1B measured on an H100 in
issue 9; it is an input of the simulation, not a measurement of kiln. The result says what the host costs a step
that long; the real figures come from bench/decode.py and `kiln bench throughput` on a GPU.
Writes bench/results/pipeline_sim-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
from bench_meta import result_path, run_metadata, write_json
from host_step import Limits, NullModel, ms

from kiln.runtime import batch_sampler
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"sync": dict(overlap_outputs=False, async_scheduling=False),
         "overlap": dict(overlap_outputs=True, async_scheduling=False),
         "async": dict(overlap_outputs=True, async_scheduling=True)}


class SimDevice:
    """A device clock: each launch queues `step_s` after the previous one; a read waits for its launch's end."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.busy_until = 0.0
        self.pending: deque[float] = deque()  # end times of launched steps not read yet, in launch order
        self.wait_s = 0.0
        self.launches = self.reads = 0
        self.idle_launches = 0  # launches that found the device idle (it waited for the host)

    def launch(self) -> None:
        now = time.perf_counter()
        self.idle_launches += self.busy_until < now
        self.busy_until = max(self.busy_until, now) + self.step_s
        self.pending.append(self.busy_until)
        self.launches += 1

    def read(self) -> None:
        end = self.pending.popleft()  # steps are read in launch order (one sampled read per decode step)
        self.reads += 1
        t = time.perf_counter()
        while time.perf_counter() < end:  # spin, as a CUDA stream sync does by default
            pass
        self.wait_s += time.perf_counter() - t


class SimModel(NullModel):
    def __init__(self, vocab: int, device: SimDevice):
        super().__init__(vocab)
        self.sim = device

    def __call__(self, batch, kv_cache):
        self.sim.launch()
        return super().__call__(batch, kv_cache)


def run(mode: str, num_seqs: int, steps: int, prompt_len: int, vocab: int, detokenize: bool, device_ms: float) -> dict:
    sim = SimDevice(device_ms / 1e3)
    model = SimModel(vocab, sim)
    blocks = num_seqs * -(-(prompt_len + steps + 4) // model.block_size) + 260  # + one max-length sequence
    engine = Engine(model, ByteTokenizer(vocab) if detokenize else None, Limits(), max_num_seqs=num_seqs,
                    num_blocks=blocks, max_num_batched_tokens=max(2048, prompt_len * num_seqs), **MODES[mode])
    params = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(num_seqs):
        engine.add_request(prompt_token_ids=torch.randint(vocab, (prompt_len,), generator=g).tolist(), params=params)
    real = batch_sampler.LaunchedSample.result

    def result(self):
        sim.read()
        return real(self)

    batch_sampler.LaunchedSample.result = result
    try:
        engine.step()  # the prefill of every prompt
        engine.step()  # the first decode (async: left in flight)
        times, waits, tokens, idle = [], [], 0, sim.idle_launches
        for _ in range(steps):
            w, t = sim.wait_s, time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t)
            waits.append(sim.wait_s - w)
            tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        idle = sim.idle_launches - idle
        while engine.has_unfinished():
            engine.step()
    finally:
        batch_sampler.LaunchedSample.result = real
    assert tokens == steps * num_seqs, "every request decodes one token per step"
    assert sim.reads == sim.launches, "a launched step was never read"
    step = statistics.median(times)
    return {"mode": mode, "seqs": num_seqs, "step_ms_median": ms(step), "tok_s": round(num_seqs / step, 1),
            "wait_ms_median": ms(statistics.median(waits)),
            "host_ms_median": ms(statistics.median(t - w for t, w in zip(times, waits, strict=True))),
            "device_idle_share": round(max(0.0, 1 - device_ms / 1e3 / step), 3), "idle_launches": idle,
            "steps_ahead": engine.stats.num_steps_ahead}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--device-ms", type=float, default=1.46, help="simulated device time of one decode step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--detokenize", action="store_true", help="detokenize outputs (byte-level tokenizer)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    for n in args.seqs:
        for mode in MODES:
            row = run(mode, n, args.steps, args.prompt_len, args.vocab, args.detokenize, args.device_ms)
            print(row, file=sys.stderr)
            rows.append(row)
    result = {"bench": "pipeline_sim", **run_metadata(), "device_ms": args.device_ms, "steps": args.steps,
              "prompt_len": args.prompt_len, "vocab": args.vocab, "detokenize": args.detokenize,
              "note": "simulated device: each model call queues device_ms on a clock and the sampled-ids copy waits "
                      "for it; device_ms is an input, not a measured kiln figure",
              "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows}
    path = write_json(result_path(args.out_dir, "pipeline_sim"), result)
    print(f"wrote {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
