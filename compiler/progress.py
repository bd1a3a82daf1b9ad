"""When long work shows a progress bar: one rule for weight loading, random weights and kernel builds."""

from __future__ import annotations

PROGRESS_THRESHOLD = 1 << 30  # bytes: loading or generating more than this shows a byte-count bar on stderr
KERNEL_PROGRESS_MIN = 8  # kernels: compiling (or loading) at least this many shows a bar
