"""What a pass is: a named graph rewrite `gm -> PassResult(gm, modified)` and the passes it requires.

It lives here, beside the passes, so that a pass imports nothing above it; the driver (kiln.compile.pipeline)
imports the passes, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool


@dataclass(frozen=True)
class Pass:
    """A named graph rewrite. `run` edits gm.graph (and gm's parameters) in place and says whether it changed
    anything; the driver recompiles and refreshes node.meta["val"] afterwards."""

    name: str
    run: Callable[[fx.GraphModule], PassResult]
    requires: tuple[str, ...] = ()  # passes that must run before this one (when both are in the pipeline)
    doc: str = ""
