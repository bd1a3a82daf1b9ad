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
    # passes that must run earlier in the same pipeline: build_pipeline (kiln.compile.pipeline.check_order)
    # refuses a pipeline that lacks one or runs it later with a PassError, and never reorders
    requires: tuple[str, ...] = ()
    doc: str = ""
