"""The server tests' shared fixtures: tiny-llama on the reference ops (one per test module), and a server on an
engine of its own over the same weights, so that the module's `llm` can compute reference values beside it. A
module that needs another server defines its own `url`."""

from __future__ import annotations

import pytest

from tests.support.served_llm import serve_llm


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)


@pytest.fixture(scope="module")
def url(llm):
    with serve_llm(llm) as u:
        yield u
