"""Codegen's dry-run recording is per thread: a compile that lists its kernels in one thread (a drafter, a Dynamo
graph) leaves the kernels another thread launches meanwhile (the engine's steps) running for real."""

from __future__ import annotations

import threading

import torch

from kiln.codegen._host import recording
from kiln.codegen.norm import rms_norm
from kiln.ir import ops


def test_a_recording_in_another_thread_leaves_this_threads_launches_running():
    recorded: list[str] = []
    started, done = threading.Event(), threading.Event()

    def compile_elsewhere() -> None:
        with recording(lambda template, name, args, **params: recorded.append(template)):
            started.set()
            done.wait(60)
            rms_norm(torch.randn(3, 40), torch.randn(40), 1e-5)  # this thread's launch is still recorded

    other = threading.Thread(target=compile_elsewhere)
    other.start()
    try:
        assert started.wait(60)
        x, w = torch.randn(5, 40), torch.randn(40)
        out = rms_norm(x, w, 1e-5)  # runs while the other thread records
    finally:
        done.set()
        other.join(60)
    torch.testing.assert_close(out, ops.rms_norm(x, w, 1e-5), rtol=1e-4, atol=1e-5)
    assert recorded == ["norm"]
