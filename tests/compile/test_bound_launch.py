"""What runs per kernel launch in a lowered graph: kernels are bound at lowering (codegen's BoundKernels), so a
launch does no kernel-cache lookup, reads no environment variable and, outside KILN_DEBUG, runs no tensor check;
what is decided once (tiles, the device's capability) is not decided again per launch.

Counted with sys.setprofile over a second run (the first one loads each kernel instance once into its node's
binding) of a compiled tiny model (compile_model) and of compiled step models (compile_step, what the engine runs):
a prefill step and a decode step, dense, quantized (int4 weights, int8 KV cache, a pinned flash tile) and
Mixture-of-Depths, and a step model's speculative verification. The bound kernels themselves run with the
profiler off: Triton's interpreter makes millions of Python calls of its own, none of them kiln's host work.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import fx

from kiln import env
from kiln.codegen import flash_attn
from kiln.codegen._host import BoundKernels
from kiln.codegen.flash_attn import flash_attention
from kiln.codegen.norm import rms_norm
from kiln.codegen.tiles import TileConfig
from kiln.compile.driver import compile_model
from kiln.compile.step import CompiledStep, allocate_kv_cache, compile_step, make_verifier
from kiln.ir.frontend import build_graph
from kiln.spec.loader import bundled_spec, load_spec, parse_and_resolve
from kiln.step import KVCache, StepBatch, VerifyBatch
from tests.support.paged_helper import shuffled_block_tables, step_batch

KILN_DIRS = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("compiler", "codegen", "passes", "runtime"))
ENV_FILE = str(Path(env.__file__).resolve())
_ARANGE = ("flash_attn.py", "torch.arange")  # a C call, counted by the kiln file that makes it


class _Quiet:
    """A bound kernel that launches with the profiler off and back on after."""

    def __init__(self, kernel, prof):
        self.kernel, self.prof = kernel, prof

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def run(*args, **kwargs):
            sys.setprofile(None)
            try:
                return launcher(*args, **kwargs)
            finally:
                sys.setprofile(self.prof)

        return run


@contextmanager
def _quiet(sites: Iterable[BoundKernels], prof) -> Iterator[None]:
    saved = [(site, dict(site.kernels)) for site in sites]
    for site, kernels in saved:
        site.kernels.update({key: _Quiet(k, prof) for key, k in kernels.items()})
    try:
        yield
    finally:
        for site, kernels in saved:
            site.kernels.clear()
            site.kernels.update(kernels)


def _sites(gm: fx.GraphModule) -> list[BoundKernels]:
    return [n.target for n in gm.graph.nodes if isinstance(n.target, BoundKernels)]


def _reads_environ(frame) -> bool:
    """os.environ[...], .get, `in` or os.getenv (by object and module: os is frozen, its file is "<frozen os>")."""
    code = frame.f_code
    if code.co_name == "getenv":
        return frame.f_globals.get("__name__") == "os"
    reads = code.co_name in ("get", "__getitem__", "__contains__")
    return reads and isinstance(frame.f_locals.get("self"), os._Environ)


def _profile(fn: Callable[[], object], sites: Iterable[BoundKernels] = ()) -> tuple[Counter, int]:
    """(calls by (file name, function), environment reads made from kiln's own code) while fn runs. A dataclass's
    generated methods count under their class's name (("TileConfig", "__init__")); kiln.env's functions and
    os.environ reads from kiln's code count as environment reads."""
    calls: Counter = Counter()
    env_reads = 0

    def prof(frame, event, arg):
        nonlocal env_reads
        if event == "c_call":
            if arg is torch.arange:
                calls[(Path(frame.f_code.co_filename).name, "torch.arange")] += 1
            return
        if event != "call":
            return
        code = frame.f_code
        where = Path(code.co_filename).name
        if code.co_filename == "<string>":
            where = type(frame.f_locals.get("self")).__name__
        calls[(where, code.co_name)] += 1
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if (_reads_environ(frame) and caller.startswith(KILN_DIRS)) or code.co_filename == ENV_FILE:
            env_reads += 1

    with _quiet(sites, prof):
        sys.setprofile(prof)
        try:
            fn()
        finally:
            sys.setprofile(None)
    return calls, env_reads


def _assert_bound(calls: Counter, env_reads: int, *, checked: bool = False) -> None:
    """Nothing looked up, read or decided again per launch; no full tensor check unless `checked`."""
    assert calls[("_host.py", "launch")] > 0, "the probe saw no launch"
    assert calls[("cache.py", "load")] == calls[("cache.py", "kernel_key")] == 0
    assert calls[("cache.py", "load_kernel")] == calls[("_host.py", "load_kernel")] == 0
    assert env_reads == 0
    if not checked:
        assert calls[("_host.py", "_check_tensor_full")] == 0
    assert calls[("tiles.py", "validate")] == calls[("tiles.py", "default_tile")] == 0, "a tile decided per launch"
    assert calls[("TileConfig", "__init__")] == 0, "a TileConfig built per launch"
    assert calls[("__init__.py", "get_device_capability")] == 0


# ---- compile_model: the dense graph ------------------------------------------------------------------------


def _compiled(monkeypatch, debug: str, overrides: dict[str, bool] | None = None):
    monkeypatch.setenv("KILN_DEBUG", debug)  # read once, when the graph is lowered
    spec = load_spec("tiny-llama")
    compiled = compile_model(build_graph(spec.model, seed=0), spec.compile, use_kernels=True, overrides=overrides)
    tokens = torch.randint(0, spec.model.vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)[None]
    return compiled, lambda: compiled(tokens, positions)


@pytest.mark.parametrize(("debug", "attention"), [("0", "flash"), ("0", "reference"), ("1", "flash")],
                         ids=["debug-off", "attention-reference", "debug-on"])  # fmt: skip
def test_a_launch_makes_no_cache_lookup_no_environment_read_and_checks_only_under_debug(monkeypatch, debug, attention):
    """attention = reference keeps kiln::attention: the flash kernel with codegen's default tile."""
    compiled, run = _compiled(monkeypatch, debug, {"flash_tiling": attention == "flash"})
    run()  # loads each kernel instance into its node's binding
    calls, env_reads = _profile(run, _sites(compiled.gm))
    launches = calls[("_host.py", "launch")]
    assert launches >= 8, "the tiny model launches norm, rope, attention and act kernels"
    _assert_bound(calls, env_reads, checked=debug == "1")
    full_checks = calls[("_host.py", "_check_tensor_full")]
    if debug == "1":  # the probe sees checks when they run: KILN_DEBUG keeps every wrapper's checks
        assert full_checks >= launches
    attention_calls = calls[("flash_attn.py", "flash_attention")]
    assert attention_calls == 2 and calls[_ARANGE] == 0, "the dense offsets are made once per shape, not per call"


def test_a_direct_wrapper_call_goes_through_the_cache_and_checks(monkeypatch):
    """The probe above can fail: an unbound call (a wrapper used directly) looks the kernel up and checks; a tile
    built and checked, and the offsets a dense attention makes, are seen."""
    monkeypatch.setenv("KILN_DEBUG", "0")
    x, w = torch.randn(3, 40), torch.randn(40)
    rms_norm(x, w, 1e-5)
    calls, _ = _profile(lambda: rms_norm(x, w, 1e-5))
    assert calls[("cache.py", "load")] == 1 and calls[("_host.py", "_check_tensor_full")] >= 2
    calls, _ = _profile(lambda: TileConfig(16, 16, 4, 1).validate())
    assert calls[("TileConfig", "__init__")] == calls[("tiles.py", "validate")] == 1
    q = torch.randn(1, 4, 32)
    monkeypatch.setattr(flash_attn, "_OFFSETS", OrderedDict())  # a shape never seen: its offsets are made, then kept
    calls, _ = _profile(lambda: flash_attention(q, q, q, 2, 2, True, 0, 0.25))
    assert calls[_ARANGE] == 1
    calls, _ = _profile(lambda: flash_attention(q, q, q, 2, 2, True, 0, 0.25))
    assert calls[_ARANGE] == 0


# ---- compile_step: what the engine runs --------------------------------------------------------------------

STEP_SPECS = {
    "dense": lambda: load_spec("tiny-llama"),
    "quantized": lambda: parse_and_resolve(bundled_spec("tiny-llama").read_text(encoding="utf-8").replace(
        "dtype = fp32", "dtype = fp32\n  quantize = int4(group = 32)\n  kv_cache = paged(dtype = int8)\n"
        "  attention = flash(block_m = 16, block_n = 16)")),
    "routed": lambda: load_spec("tiny-llama-mod"),
}  # fmt: skip


def _steps(step: CompiledStep, vocab: int) -> tuple[StepBatch, StepBatch, KVCache]:
    """A prefill of two sequences and the decode after it, and a cache for both."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 6)]
    tables, num_blocks = shuffled_block_tables([7, 6], 4, seed=1)
    prefill = step_batch(seqs, [(0, 6), (0, 5)], tables, 4)
    decode = step_batch(seqs, [(6, 7), (5, 6)], tables, 4)
    if step.num_routed_layers:  # every routed layer empty before the prefill, with the dense tables' blocks
        r = step.num_routed_layers
        routed = dict(routed_lens=torch.zeros(r, 2, dtype=torch.int32),
                      routed_block_tables=prefill.block_tables.expand(r, *prefill.block_tables.shape).contiguous())
        prefill, decode = dataclasses.replace(prefill, **routed), dataclasses.replace(decode, **routed)
    return prefill, decode, allocate_kv_cache(step, num_blocks, 4, routed_num_blocks=num_blocks)


@pytest.fixture(scope="module", params=list(STEP_SPECS))
def step_model(request):
    spec = STEP_SPECS[request.param]()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_DEBUG", "0")  # read once, when the graph is lowered
        step = compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, use_kernels=True)
    return request.param, step, spec.model.vocab


def test_a_step_launch_makes_no_cache_lookup_no_environment_read_and_no_check(step_model):
    name, step, vocab = step_model
    prefill, decode, cache = _steps(step, vocab)

    def run():
        step(prefill, cache)
        step(decode, cache)

    run()  # loads each kernel instance into its node's binding
    calls, env_reads = _profile(run, _sites(step.gm))
    _assert_bound(calls, env_reads)
    assert calls[("paged.py", "paged_attention_prefill")] == calls[("paged.py", "paged_attention_decode")] > 0
    if name == "quantized":
        assert calls[("quant.py", "linear_w4")] > 0 and step.kv_dtype == torch.int8
    if name == "routed":
        assert calls[("mod.py", "mod_route")] > 0


def test_a_verification_makes_no_cache_lookup_and_no_environment_read():
    """A step model's verify (make_verifier, bound when compiled with both kernel instances loaded) checks its inputs
    on every call by design (the runtime builds them; no fake propagation vetted them), and does nothing else."""
    verify, vocab = make_verifier(512, use_kernels=True), 512
    g = torch.Generator().manual_seed(0)
    b, k = 2, 3
    probs = torch.softmax(torch.randn(b, k + 1, vocab, generator=g), -1)
    drafts, num_drafts = torch.randint(0, vocab, (b, k), generator=g), torch.tensor([3, 1], dtype=torch.int32)
    batch = VerifyBatch(probs, drafts, None, num_drafts, torch.rand(b, k, generator=g),
                        torch.rand(b, vocab, generator=g) + 0.1)  # fmt: skip
    drafted = dataclasses.replace(batch, draft_probs=torch.softmax(torch.randn(b, k, vocab, generator=g), -1))

    def run():
        verify(batch)
        verify(drafted)

    run()
    calls, env_reads = _profile(run, [verify.fn])
    assert calls[("spec_verify.py", "spec_verify")] == 2
    _assert_bound(calls, env_reads, checked=True)
