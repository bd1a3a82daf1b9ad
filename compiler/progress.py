"""When long work shows a progress bar (one rule for weight loading, random weights and kernel builds), and the
status lines long work and loading write for humans (`say`)."""

from __future__ import annotations

import logging
import sys

PROGRESS_THRESHOLD = 1 << 30  # bytes: loading or generating more than this shows a byte-count bar on stderr
KERNEL_PROGRESS_MIN = 8  # kernels: compiling (or loading) at least this many shows a bar


# Status lines for humans (what is loaded, notes on the settings, a command's progress): INFO records of their own
# logger, which the CLI always prints on stderr as `kiln: message` while kiln's other INFO records wait for --debug.
status = logging.getLogger("kiln.status")


def say(msg: str) -> None:
    """A one-line status message for humans, on stderr so stdout stays clean for text and JSON: an INFO record of
    `kiln.status`, which the CLI prints as `kiln: msg`. In a program that has set up no logging (no handler on the
    root logger or kiln's) it is printed the same way, as vLLM's LLM shows its INFO lines and as logging's own last
    resort shows warnings; a level set on `kiln` or `kiln.status` still decides. Once the program sets up logging,
    its handlers and levels decide alone."""
    kiln = logging.getLogger("kiln")
    if logging.getLogger().handlers or kiln.handlers or status.handlers:
        status.info("%s", msg)
    elif not (kiln.level or status.level) or status.isEnabledFor(logging.INFO):
        print(f"kiln: {msg}", file=sys.stderr, flush=True)
