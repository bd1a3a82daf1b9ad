"""Every environment variable kiln reads, in one place.

| variable | effect |
| --- | --- |
| KILN_DEBUG | 1: every pass is followed by lint, fake propagation and an IR check; kernel wrappers check every tensor |
| KILN_DUMP_DIR | a directory: the graph after every pass is written there (kernels: `kiln compile --emit`) |
| KILN_CACHE_DIR | where generated kernels are cached (default ~/.cache/kiln/kernels); tuned tiles go to its autotune/ |
| KILN_AUTOTUNE | 0: tiles from the heuristic table, never timed on the GPU nor read from autotune/ (default 1) |
| KILN_FLASH_TMA | 1: the flash kernel loads Q/K/V through TMA tensor descriptors on sm90+ (default 0, until measured) |
| TRITON_INTERPRET | 1: Triton runs kernels in its interpreter on CPU; triton reads it once, when first imported |
| TQDM_DISABLE | set (not 0): progress bars whose caller leaves `progress` unset stay off (router training, training) |
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


def _flag(name: str, default: str = "") -> bool:
    return os.environ.get(name, default) not in ("", "0")


def debug() -> bool:
    return _flag("KILN_DEBUG")


def dump_dir() -> Path | None:
    value = os.environ.get("KILN_DUMP_DIR")
    return Path(value) if value else None


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln" / "kernels")


def progress_bars() -> bool:
    """Whether a progress bar left to the default shows: tqdm's own TQDM_DISABLE switches them off (an explicit
    `disable=` would override tqdm's reading of it, so kiln reads it here)."""
    return not _flag("TQDM_DISABLE")


def autotune() -> bool:
    return _flag("KILN_AUTOTUNE", "1")


@functools.cache
def flash_tma() -> bool:
    """Read once: a lowered graph's launches read no environment."""
    return _flag("KILN_FLASH_TMA")


@functools.cache
def triton_interpret() -> bool:
    """Whether generated kernels run in Triton's interpreter. Read once: triton itself reads the variable only
    when it is first imported, so a later change would not take effect anyway."""
    return os.environ.get("TRITON_INTERPRET") == "1"
