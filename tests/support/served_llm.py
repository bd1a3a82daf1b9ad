"""A server on its own engine over an LLM's weights (tests/server's fixtures), so that the test's `llm` can compute
reference values beside it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_llm(llm, **config) -> Iterator[str]:
    """Serve `llm`'s model as "tiny-llama" with ServerConfig(**config) on an engine of 64 blocks; yields the URL."""
    from kiln.runtime.engine import Engine
    from kiln.server import ServerConfig
    from kiln.server.background import serve_in_thread

    eng = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    with serve_in_thread(eng, ServerConfig(model_name="tiny-llama", **config)) as url:
        yield url
