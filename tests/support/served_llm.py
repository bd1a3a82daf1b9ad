"""A server on its own engine over an LLM's weights (tests/server's fixtures), so that the test's `llm` can compute
reference values beside it; or on an engine the test gives: llm.engine, or one of llm_engine's that the test looks
into or that has a part of its own (an Engine subclass, another tokenizer, slow steps)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def llm_engine(llm, cls=None, *, tokenizer=None, num_blocks: int = 64, step_s: float = 0.0, **engine_args):
    """An engine of its own over `llm`'s weights: cls(step_model, tokenizer, model config, num_blocks=num_blocks,
    **engine_args), cls None: Engine, tokenizer None: llm's; step_s > 0: each step takes at least that long (a slow
    device, so that requests are still in flight when the test acts)."""
    from kiln.runtime.engine import Engine

    base = Engine if cls is None else cls
    if step_s > 0:

        class Slow(base):
            def step(self):
                time.sleep(step_s)
                return super().step()

        base = Slow
    return base(llm.step_model, llm.tokenizer if tokenizer is None else tokenizer, llm.loaded.model,
                num_blocks=num_blocks, **engine_args)


@contextmanager
def serve_llm(llm, *, engine=None, model_name: str | Sequence[str] = "tiny-llama", drain_s: float | None = None,
              **config) -> Iterator[str]:
    """Serve `llm`'s model as model_name (a list: several served names) with ServerConfig(**config) on `engine`
    (None: llm_engine(llm), an engine of 64 blocks of its own); drain_s as serve_in_thread's. Yields the URL."""
    from kiln.server import ServerConfig
    from kiln.server.background import serve_in_thread

    eng = llm_engine(llm) if engine is None else engine
    with serve_in_thread(eng, ServerConfig(model_name=model_name, **config), drain_s=drain_s) as url:
        yield url
