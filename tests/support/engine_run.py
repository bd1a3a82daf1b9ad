"""Drive an Engine until every request has finished."""

from __future__ import annotations

from kiln.runtime.engine import Engine
from kiln.runtime.outputs import RequestOutput


def finish_all(eng: Engine, max_steps: int = 200) -> dict[str, RequestOutput]:
    """Step until nothing is left (failing if the engine stops making progress); each request's final output."""
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert not eng.has_unfinished(), "the engine stopped making progress"
    return final
