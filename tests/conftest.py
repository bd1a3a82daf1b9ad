"""Test-wide set-up. The Triton interpreter must be enabled before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KILN_DEBUG", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
