"""The whole batch-1 decode step of bench/quant.py: time per scheme, and what the bf16 step launches.

A step is the compiled Level-1 graph (kiln.compile.driver.compile_model, generated kernels, quantized linears
through their kernels) on one token at position 0, replayed as a CUDA graph so launch overhead does not hide the
weight reads. Every weight but the embedding table is read once per step.

`launch_profile` counts the launches from the lowered graph: each kiln kernel call is run in codegen's dry-run
`recording` mode on FakeTensors (so the wrappers choose their kernels, splits and reduce passes exactly as they
will at run time, and launch nothing), each other non-view call is one torch launch. On CUDA the count is checked
against torch.profiler's kernel count for one eager step.
"""

from __future__ import annotations

import operator
import sys
import time
from collections import Counter
from functools import partial

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

# torch calls that launch nothing (views and tuple access)
_VIEWS = {"getitem", "view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "split", "narrow", "expand",
          "slice", "select", "unflatten", "flatten", "t", "chunk", "unbind", "as_strided", "size",
          "split_with_sizes", "alias", "detach"}  # fmt: skip
# the ops a decode step cannot do without: GEMMs and attention; everything else is a separate memory pass
_MAIN_OPS = {"linear", "linear_w8", "linear_w4", "attention", "flash_attention", "paged_attention"}


def _name(target) -> str:
    """A node's op name: kiln.linear_w4.default / aten.view.default -> linear_w4 / view; F.linear -> linear."""
    if target is operator.getitem:
        return "getitem"
    text = target if isinstance(target, str) else str(target) if isinstance(target, torch._ops.OpOverload) else (
        getattr(target, "__name__", None) or str(target))
    parts = text.split(".")
    return parts[-2] if len(parts) >= 3 else parts[-1]


class _Counter(fx.Interpreter):
    """Runs a lowered graph on FakeTensors inside codegen's recording dry run, counting launches per node."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device):
        super().__init__(gm)
        self.mode, self.device = mode, device
        self.rows: list[tuple[str, str, int]] = []  # (op, runs as, launches)
        self._templates: list[str] = []

    def fetch_attr(self, target: str):
        t = super().fetch_attr(target)
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def record(self, template: str, name: str, args, **params) -> None:
        self._templates.append(template)

    def run_node(self, n: fx.Node):
        self._templates = []
        result = super().run_node(n)
        if n.op in ("call_function", "call_method"):
            op = _name(n.meta.get("kiln_op") or n.target)
            if self._templates:
                self.rows.append((op, "kiln:" + "+".join(sorted(set(self._templates))), len(self._templates)))
            elif op not in _VIEWS:
                self.rows.append((op, "torch", 1))
        return result


def launch_profile(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> dict:
    """Launches per call of a lowered graph and, per op, how many nodes and launches it has and what runs it."""
    from kiln.codegen._host import recording

    ref = next(iter([*gm.parameters(), *gm.buffers()]), None)
    device = ref.device if ref is not None and ref.device.type == "cuda" else torch.device("meta")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in inputs]
    counter = _Counter(gm, mode, device)
    with recording(counter.record), mode:
        counter.run(*fake)
    nodes, launches, runs_as = Counter(), Counter(), {}
    for op, how, count in counter.rows:
        nodes[op] += 1
        launches[op] += count
        runs_as[op] = how
    ops = [{"op": op, "nodes": nodes[op], "launches": launches[op], "runs_as": runs_as[op]}
           for op in sorted(nodes, key=lambda o: -launches[o])]  # fmt: skip
    return {
        "launches_per_step": sum(launches.values()),
        "ops": ops,
        "not_fused": [o["op"] for o in ops if o["op"] not in _MAIN_OPS],
    }


def profiled_kernels(fn) -> int:
    """CUDA kernels one call of fn launches, counted by torch.profiler (memcpy / memset excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for e in kernels if "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def bytes_read_per_step(gm: fx.GraphModule) -> int:
    """Weight bytes a one-token step reads: every tensor, except tables only gathered from (embeddings)."""
    gathers = {"embedding", "embedding_q", "k_embedding", "k_embedding_q"}
    skip = {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and n.users
        and all(u.op == "call_function" and _name(u.meta.get("kiln_op") or u.target) in gathers for u in n.users)
    }  # fmt: skip
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name not in skip)


def time_step(fn, iters: int) -> tuple[float, bool]:
    """Mean seconds per call of fn(), replayed as a CUDA graph when capture works (else called eagerly)."""
    side = torch.cuda.Stream()  # warm up (kernel loads, allocator) on a side stream, as capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run, captured = graph.replay, True
    except Exception as e:  # a kernel that cannot be captured: measure eagerly and say so
        print(f"bench: CUDA graph capture failed ({type(e).__name__}: {e}); timing eager calls", file=sys.stderr)
        run, captured = fn, False
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, captured


def compiled_step(spec: str, scheme: str, device: str, dtype: torch.dtype):
    """(compiled model, its inputs, seconds quantizing) for one token at position 0."""
    from kiln.compile.driver import compile_model
    from kiln.compile.pipeline import quantize_graph
    from kiln.ir.frontend import build_graph
    from kiln.model_config import CompileConfig
    from kiln.spec.loader import load_spec

    cfg = load_spec(spec).model
    gm = build_graph(cfg, dtype=dtype, device=device)
    t0 = time.perf_counter()
    if scheme != "bf16":
        gm = quantize_graph(gm, scheme)
    quantize_s = time.perf_counter() - t0
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    compiled = compile_model(gm, CompileConfig(dtype=name), use_kernels=True)
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
    positions = torch.zeros(1, 1, dtype=torch.long, device=device)
    return compiled, [tokens, positions], quantize_s


def measure_step(spec: str, scheme: str, iters: int, ceiling: float) -> dict:
    """The step figure of one scheme on CUDA (bf16 also with its launch profile)."""
    compiled, inputs, quantize_s = compiled_step(spec, scheme, "cuda", torch.bfloat16)
    nbytes = bytes_read_per_step(compiled.gm)
    with torch.inference_mode():
        step_s, captured = time_step(partial(compiled, *inputs), iters)
        row = {"scheme": scheme, "step_ms": step_s * 1e3, "tokens_per_s": 1 / step_s, "bytes_per_step": nbytes,
               "gb_per_s": nbytes / step_s / 1e9, "pct_of_copy_bw": 100 * nbytes / step_s / 1e9 / ceiling,
               "cuda_graph": captured, "quantize_s": quantize_s}  # fmt: skip
        row["launches"] = launch_profile(compiled.gm, inputs)
        try:
            row["launches"]["profiled_kernels_per_step"] = profiled_kernels(partial(compiled, *inputs))
        except Exception as e:  # the profiler (CUPTI) is a cross-check; its absence must not lose the run
            row["launches"]["profiled_kernels_per_step"] = f"unavailable: {type(e).__name__}: {e}"
    del compiled
    torch.cuda.empty_cache()
    return row
