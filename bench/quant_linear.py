"""What bench/quant.py times one linear with: the weight in each scheme (with copies that defeat the L2 cache),
and CUDA-graph timing of back-to-back calls (the copy bandwidth is bench/ceilings.py's)."""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch


class Linear:
    """One weight in one scheme on a device, with `copies` clones so timed calls do not hit L2."""

    def __init__(self, n: int, k: int, scheme: str, device: str, dtype: torch.dtype, copies: int = 1, seed: int = 0):
        from kiln.quant.formats import dequantize, parse_scheme, quantize_rtn

        g = torch.Generator(device=device).manual_seed(seed)
        w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        self.scheme, self.n, self.k = scheme, n, k
        if scheme == "bf16":
            parts = [(w,)]
            self.reference = w
        else:
            qw = quantize_rtn(w, parse_scheme(scheme))
            parts = [(qw.qweight, qw.scales, qw.zeros, qw.group)]
            self.reference = dequantize(qw, dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in parts[0] if isinstance(t, torch.Tensor))
        for _ in range(copies - 1):
            parts.append(tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in parts[0]))
        self.parts = parts

    def call(self, i: int, x: torch.Tensor, out: torch.Tensor, tile=None) -> torch.Tensor:
        from kiln.codegen.quant import linear_w4, linear_w8

        p = self.parts[i % len(self.parts)]
        if self.scheme == "bf16":
            return torch.nn.functional.linear(x, p[0])
        if self.scheme == "int8":
            return linear_w8(x, p[0], p[1], out=out, tile=tile)
        return linear_w4(x, p[0], p[1], p[2], p[3], out=out, tile=tile)

    def check(self, x: torch.Tensor, tile=None) -> float:
        """Max |kernel - dequantize-then-matmul| relative to the reference's largest entry."""
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)
        got = self.call(0, x, out, tile).float()
        want = x.float() @ self.reference.float().T
        return ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()


def time_calls(fns, repeats: int = 7, replays: int = 5) -> float:
    """Median seconds per call of the fns, captured back to back in one CUDA graph (called eagerly, with a warning,
    if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        run = graph.replay
    except Exception as e:  # any capture failure: time eagerly rather than lose the run
        print(f"bench: CUDA graph capture failed ({type(e).__name__}: {e}); timing eager calls", file=sys.stderr)
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays / len(fns))
    return statistics.median(times)


def time_linear(lin: Linear, x: torch.Tensor, out: torch.Tensor, tile=None) -> float:
    """Seconds per call of lin on x, each call reading another copy of the weight (at least 4 calls)."""
    return time_calls([partial(lin.call, i, x, out, tile) for i in range(max(len(lin.parts), 4))])


def copies_for(nbytes: int, device: str) -> int:
    """Weight copies one measurement cycles through: their bytes exceed the L2 cache three times (1 off CUDA)."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(64, -(-3 * l2 // nbytes)))
