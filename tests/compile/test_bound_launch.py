"""What runs per kernel launch in a lowered graph: kernels are bound at lowering (codegen's BoundKernels), so a
launch does no kernel-cache lookup, reads no environment variable and, outside KILN_DEBUG, runs no tensor check.

Counted with sys.setprofile over a second forward pass of a compiled tiny model (the first one loads each
kernel instance once).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from kiln.compile.driver import compile_model
from kiln.ir.frontend import build_graph
from kiln.spec.loader import load_spec

KILN_DIRS = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("compiler", "codegen", "passes", "runtime"))


def _profile(fn) -> tuple[Counter, int]:
    """(calls by (file name, function), environment reads made from kiln's own code) while fn runs."""
    calls: Counter = Counter()
    env_reads = 0

    def prof(frame, event, arg):
        nonlocal env_reads
        if event != "call":
            return
        code = frame.f_code
        calls[(Path(code.co_filename).name, code.co_name)] += 1
        is_env = code.co_filename.endswith(("os.py", "_collections_abc.py")) and code.co_name in ("get", "__getitem__")
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if is_env and caller.startswith(KILN_DIRS):
            env_reads += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, env_reads


def _compiled(monkeypatch, debug: str):
    monkeypatch.setenv("KILN_DEBUG", debug)  # read once, when the graph is lowered
    spec = load_spec("tiny-llama")
    compiled = compile_model(build_graph(spec.model, seed=0), spec.compile, use_kernels=True)
    tokens = torch.randint(0, spec.model.vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)[None]
    return lambda: compiled(tokens, positions)


@pytest.mark.parametrize("debug", ["0", "1"], ids=["debug-off", "debug-on"])
def test_a_launch_makes_no_cache_lookup_no_environment_read_and_checks_only_under_debug(monkeypatch, debug):
    run = _compiled(monkeypatch, debug)
    run()  # loads each kernel instance into its node's binding
    calls, env_reads = _profile(run)
    launches = calls[("_host.py", "launch")]
    assert launches >= 8, "the tiny model launches norm, rope, attention and act kernels"
    assert calls[("cache.py", "load")] == calls[("cache.py", "kernel_key")] == 0
    assert calls[("cache.py", "load_kernel")] == 0
    assert env_reads == 0
    full_checks = calls[("_host.py", "_check_tensor_full")]
    if debug == "0":
        assert full_checks == 0
    else:  # the probe sees checks when they run: KILN_DEBUG keeps every wrapper's checks
        assert full_checks >= launches


def test_a_direct_wrapper_call_goes_through_the_cache_and_checks(monkeypatch):
    """The probe above can fail: an unbound call (a wrapper used directly) looks the kernel up and checks."""
    from kiln.codegen.norm import rms_norm

    monkeypatch.setenv("KILN_DEBUG", "0")
    x, w = torch.randn(3, 40), torch.randn(40)
    rms_norm(x, w, 1e-5)
    calls, _ = _profile(lambda: rms_norm(x, w, 1e-5))
    assert calls[("cache.py", "load")] == 1 and calls[("_host.py", "_check_tensor_full")] >= 2
