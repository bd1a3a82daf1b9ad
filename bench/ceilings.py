"""The device ceilings benchmarks report their figures against, measured in the same run: the copy bandwidth
(dst.copy_(src) of one buffer; each copy reads and writes it), the practical limit for streaming weights and KV."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second (read + write) of a device-to-device copy of nbytes, the median of iters copies (CUDA
    events on a GPU, wall time elsewhere), on random bytes (never time all-zero inputs)."""
    device = torch.device(device)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: allocation and first touch are not timed
    cuda = device.type == "cuda"
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / statistics.median(times)
