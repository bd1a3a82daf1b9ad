"""The server tests' shared fixtures: tiny-llama on the reference ops (one per test module), and a server on an
engine of its own over the same weights, so that the module's `llm` can compute reference values beside it. A
module that needs another server defines its own `url`."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)


@pytest.fixture(scope="module")
def url(llm):
    from kiln.runtime.engine import Engine
    from kiln.server import ServerConfig
    from kiln.server.background import serve_in_thread

    eng = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    with serve_in_thread(eng, ServerConfig(model_name="tiny-llama")) as u:
        yield u
