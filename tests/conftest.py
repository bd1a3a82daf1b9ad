"""Test-wide set-up.

Without CUDA the generated Triton kernels run in Triton's interpreter, which must be enabled before triton
is first imported (importing torch does not import triton). With CUDA they run for real, and the `gpu`
marked tests run too.
"""

import os
import tempfile

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KILN_DEBUG", "1")
# Generated kernels go to a per-run directory: tests never read or fill the user's ~/.cache/kiln.
os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-kernels-"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
