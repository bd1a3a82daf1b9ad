"""A failed CUDA-graph capture (StepGraphs.capture_all) keeps the engine eager with one warning, and that warning
carries the exception's traceback: where the step model synced or allocated under capture is what fixes it."""

from __future__ import annotations

import logging

import torch

from kiln.runtime.cuda_graphs import StepGraphs
from kiln.step import KVCache


def _syncs_under_capture() -> None:
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_logs_its_traceback_once_and_keeps_no_graph(caplog, monkeypatch):
    def capture(self, b, q, pool):
        _syncs_under_capture()

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # the failure is the capture's, even on CPU
    monkeypatch.setattr(StepGraphs, "_capture", capture)
    model = type("Model", (), {"device": torch.device("cpu")})()
    graphs = StepGraphs(model, KVCache(torch.zeros(1, 2, 4, 4, 1, 2)), block_size=4, max_blocks_per_seq=4,
                        max_model_len=16, num_routed=0, shapes=[(1, 1), (2, 1)])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        graphs.capture_all()
    assert graphs.graphs == {}
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in record.getMessage()
    assert "Traceback (most recent call last)" in caplog.text and "_syncs_under_capture" in caplog.text
