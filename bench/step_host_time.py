"""Host time per decode step (issue 11): what the CPU spends launching one step of a spec's compiled step model,
against what the device spends running it.

    python bench/step_host_time.py [SPEC] [--batches 1 64] [--context 512] [--steps 50] [--profile-steps 10]
                                   [--dtype bf16] [--device auto] [--tag TAG] [--out-dir DIR]
    python bench/step_host_time.py --smoke      # CPU, tiny-llama, reference ops: the plumbing only, no file
                                                # (--save-smoke: the file too)

The step model (default llama-3.2-1b, seeded random weights on the device, generated kernels on CUDA) is called
eagerly, never replayed from a CUDA graph (a replay hides exactly the launches this measures), on a decode batch
of B sequences, each one token at position --context - 1 with its own contiguous blocks. Per batch size:
- host_ms: the call's wall time until it returns, taken with the device idle before it (a sync first), so no
  launch waits for a full queue: the host's cost of a step, kernel lookups, argument checks and launches;
- wall_ms: until the device has finished too (a sync after the call), and device_ms: CUDA events around the call
  (on the device's clock: its kernels plus any gaps where it waited for the host);
- under torch.profiler (--profile-steps calls): the self CPU time of every profiled event per step (the issue's
  "profiler CPU time") and the device time of its kernels per step, and the kernel launches per step.
The figures are medians over --steps calls after warm-up calls that compile every kernel.

It measures any kiln tree that has kiln.build.load_model and compile_step (kiln.compile.step, or kiln.compile_step
before issue 11's restructure), so the same script gives "before" and "after": put the old tree's installed copy
first on PYTHONPATH (bench/gpu/session.sh hosttime does, for main 3c447db: wave 1 with the torch 2.11 fix). The
JSON records which kiln it imported (`kiln_path`) and --tag names the file:
bench/results/step_host_time[-TAG]-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import kiln
from kiln.build import load_model, resolve_device

try:  # after issue 11's restructure
    from kiln.compile.step import compile_step
    from kiln.step import StepBatch, allocate_kv_cache
except ImportError:  # the flat layout of wave 1 (main 3c447db)
    from kiln.compile_step import allocate_kv_cache, compile_step
    from kiln.runtime.step import StepBatch

try:  # the metadata every bench result has (bench_meta.py), from kiln.run_info
    from bench_meta import result_path, run_metadata, write_json
except ImportError:  # a kiln from before kiln.run_info under test: the same fields but the commit, made here

    def run_metadata() -> dict:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = None
        return {"device": dev, "torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda,
                "commit": "unknown (an installed older kiln: see kiln_path and the tag)",
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    def result_path(out_dir: str | Path, name: str) -> Path:
        slug = "".join(c if c.isalnum() else "-" for c in run_metadata()["device"].lower()).strip("-")
        return Path(out_dir) / f"{name}-{slug[:40]}-{dt.date.today().isoformat()}.json"

    def write_json(path: Path, data: dict) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path


RESULTS = Path(__file__).resolve().parent / "results"
SMOKE = ["tiny-llama", "--batches", "1", "3", "--context", "37", "--steps", "3", "--profile-steps", "2", "--dtype",
         "fp32", "--device", "cpu"]


def decode_batch(num_seqs: int, context: int, block_size: int, vocab: int, device: torch.device) -> StepBatch:
    """num_seqs sequences decoding their token at position context - 1, sequence i on blocks 1 + i * nb ..."""
    nb = -(-context // block_size)
    tables = (1 + torch.arange(num_seqs * nb, dtype=torch.int32).view(num_seqs, nb)).to(device)
    pos = context - 1
    seqs = torch.arange(num_seqs, device=device)
    g = torch.Generator().manual_seed(num_seqs)
    return StepBatch(
        tokens=torch.randint(vocab, (num_seqs,), generator=g).to(device),
        positions=torch.full((num_seqs,), pos, dtype=torch.int64, device=device),
        slot_mapping=tables[:, pos // block_size].long() * block_size + pos % block_size,
        block_tables=tables, context_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device), sample_indices=seqs,
        max_query_len=1, max_context_len=context,
    )  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernels(events: list) -> list:
    """The profiled events that ran on the GPU (kernels, copies); CPU ops carry their kernels' time too, so only
    these are summed."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if getattr(e, "device_type", None) == cuda]


def measure(step, kv, batch: StepBatch, device: torch.device, steps: int, profile_steps: int) -> dict:
    host, wall, dev = [], [], []
    cuda = device.type == "cuda"
    with torch.inference_mode():
        for _ in range(3):  # warm-up: every kernel of this shape compiled (or loaded) before timing
            step(batch, kv)
        _sync(device)
        for _ in range(steps):
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            _sync(device)
            t0 = time.perf_counter()
            if ev:
                ev[0].record()
            step(batch, kv)
            if ev:
                ev[1].record()
            t1 = time.perf_counter()
            _sync(device)
            t2 = time.perf_counter()
            host.append(t1 - t0)
            wall.append(t2 - t0)
            if ev:
                dev.append(ev[0].elapsed_time(ev[1]))
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(profile_steps):
                step(batch, kv)
            _sync(device)
    events = prof.events()
    kernels = _kernels(events)
    on_device = {id(e) for e in kernels}
    row = {"host_ms": round(statistics.median(host) * 1e3, 3), "wall_ms": round(statistics.median(wall) * 1e3, 3),
           "device_ms": round(statistics.median(dev), 3) if dev else None,
           "profiler_cpu_ms_per_step": round(sum(e.self_cpu_time_total for e in events if id(e) not in on_device) / 1e3
                                             / profile_steps, 3),
           "profiler_device_ms_per_step": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / profile_steps,
                                                3) if cuda else None,
           "kernel_launches_per_step": round(len(kernels) / profile_steps, 1) if cuda else None}
    return row


def random_fill(kv):
    """The pool filled with random values on its device (scales positive): device times are never taken over
    all-zero inputs. Both layouts' KVCache (data, scales, and a routed pool since) hold tensors as attributes."""
    torch.manual_seed(0)
    for name in ("data", "scales", "routed"):
        t = getattr(kv, name, None)
        if isinstance(t, torch.Tensor):
            if t.dtype == torch.int8:
                t.random_(-127, 128)
            elif name == "scales":
                t.uniform_(0.005, 0.02)
            else:
                t.uniform_(-1.0, 1.0)
    return kv


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default="llama-3.2-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=512, help="tokens in each sequence's cache, the new one included")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tag", help="a word for the result file's name, e.g. before")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny-llama on the CPU (plumbing only; figures mean nothing); writes no file")
    ap.add_argument("--save-smoke", action="store_true", help="with --smoke: write the JSON too (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        save_smoke = args.save_smoke
        args = ap.parse_args([*SMOKE, "--out-dir", args.out_dir, *(["--tag", args.tag] if args.tag else [])])
        args.smoke, args.save_smoke = True, save_smoke
    if min(args.batches) < 1 or args.context < 1 or args.steps < 1 or args.profile_steps < 1:
        raise SystemExit("--batches, --context, --steps and --profile-steps must be >= 1")
    device = resolve_device(args.device)
    m = load_model(args.spec, dtype=args.dtype, device=str(device), seed=0)
    step = compile_step(m.gm, m.model, m.compile, device=device, use_kernels=device.type == "cuda")
    bs = getattr(step, "block_size", 16)
    nb = -(-args.context // bs)
    kv = random_fill(allocate_kv_cache(step, max(args.batches) * nb + 1, bs))
    rows = []
    for b in args.batches:
        row = {"batch": b, "context": args.context,
               **measure(step, kv, decode_batch(b, args.context, bs, m.model.vocab, device), device, args.steps,
                         args.profile_steps)}
        print(f"batch {b}: host {row['host_ms']} ms per step, wall {row['wall_ms']} ms, device {row['device_ms']} "
              f"ms; profiler CPU {row['profiler_cpu_ms_per_step']} ms, device {row['profiler_device_ms_per_step']} "
              f"ms, {row['kernel_launches_per_step']} launches", file=sys.stderr)
        rows.append(row)
    meta = run_metadata()
    kiln_path = Path(kiln.__file__).resolve().parent
    if kiln_path != Path(__file__).resolve().parents[1] / "compiler":  # an installed older kiln: not this commit
        meta["commit"] = f"not this checkout's: the kiln at kiln_path ({args.tag or 'untagged'})"
    result = {"bench": "step_host_time", **meta, "spec": args.spec, "dtype": args.dtype,
              "smoke": args.smoke, "tag": args.tag, "kiln_path": str(kiln_path),
              "use_kernels": device.type == "cuda", "steps": args.steps, "profile_steps": args.profile_steps,
              "rows": rows}
    name = "step_host_time" + (f"-{args.tag}" if args.tag else "") + ("-smoke" if args.smoke else "")
    if args.smoke and not args.save_smoke:
        print("smoke: no file written (--save-smoke writes it)", file=sys.stderr)
    else:
        print(f"wrote {write_json(result_path(args.out_dir, name), result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
