"""Autotuning of kernel tile configs, with the winners cached on disk and reused by later processes.

A tuning problem is a kernel family plus the few things the best tile depends on (head dim, dtype, causal,
window, ...). Its key hashes the family, the device (name and compute capability), triton's version, the
text of the family's template and of every file it includes, the problem and the candidate list, so a new
GPU, a triton upgrade or an edited template tunes again, and anything else reuses the result. Results live
as one readable JSON file per key under KILN_CACHE_DIR/autotune/ (written atomically; concurrent tuners of
one key both write the same kind of answer), and an in-process memo answers repeated problems (every layer
of a model) without touching the disk.

The timing function is injectable (set_timer): on CUDA the default times with triton.testing.do_bench
(median); under TRITON_INTERPRET=1 tuning runs only with an injected timer, which is how the tests check the
tuner and its cache on CPU. `stats()` counts problems tuned, configs timed and problems loaded from disk; the
compile report prints them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kiln import env
from kiln.codegen.cache import triton_version
from kiln.codegen.render import template_sources
from kiln.codegen.tiles import TileConfig
from kiln.errors import CodegenError

Timer = Callable[[Callable[[], Any]], float]  # runs a launch (repeatedly) and returns its time in ms

log = logging.getLogger("kiln.autotune")
FORMAT = 1  # bump when the file layout changes


@dataclass
class TuneStats:
    tuned: int = 0  # problems tuned in this process (every candidate timed)
    timed: int = 0  # candidate configs timed
    failed: int = 0  # candidates that could not run on this device (shared memory, registers) and lost
    loaded: int = 0  # problems answered by a file an earlier process (or tuner) wrote

    def since(self, before: TuneStats) -> TuneStats:
        """The counts since a copy `before` of these counters was taken."""
        return TuneStats(*(getattr(self, f) - getattr(before, f) for f in ("tuned", "timed", "failed", "loaded")))

    def summary(self) -> str:
        return (f"autotune: {self.tuned} tuned ({self.timed} configs timed), "
                f"{self.loaded} loaded from the cache")


_stats = TuneStats()
_timer: Timer | None = None
_memo: dict[str, TileConfig] = {}


def stats() -> TuneStats:
    """The process's tuning counters (a live object)."""
    return _stats


def set_timer(timer: Timer | None) -> Timer | None:
    """Inject the timing function (None: the default, do_bench on CUDA); returns the previous one."""
    global _timer
    prev, _timer = _timer, timer
    return prev


def timer_injected() -> bool:
    return _timer is not None


def cuda_timer(fn: Callable[[], Any]) -> float:  # pragma: no cover (CUDA)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def tuning_device(device: torch.device) -> torch.device | None:
    """Where a graph on `device` would tune, or None when it cannot: CUDA (a meta graph targets the local GPU),
    or the interpreter when a timer was injected. KILN_AUTOTUNE=0 turns tuning off everywhere."""
    if not env.autotune():
        return None
    if device.type == "cuda":
        return device
    if device.type == "meta" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if env.triton_interpret() and _timer is not None:
        return torch.device("cpu")
    return None


def device_id(device: torch.device) -> str:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}|sm{cap[0]}{cap[1]}"
    return "triton-interpreter"


def _tile_dict(tile: TileConfig) -> dict[str, int]:
    return asdict(tile)


def problem_key(family: str, device: torch.device, problem: dict[str, Any], candidates: Sequence[TileConfig]) -> str:
    h = hashlib.sha256()
    parts = (str(FORMAT), family, device_id(device), triton_version(), *template_sources(family),
             json.dumps(problem, sort_keys=True), json.dumps([_tile_dict(c) for c in candidates]))
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _root() -> Path:
    return env.cache_dir() / "autotune"


def _path(family: str, key: str) -> Path:
    return _root() / f"{family}_{key}.json"


def _read(path: Path) -> TileConfig | None:
    try:
        data = json.loads(path.read_text())
        return TileConfig(**data["best"]).validate()
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, CodegenError) as e:  # a torn or foreign file: tune again
        log.warning("autotune cache file %s is unreadable (%s); tuning again", path, e)
        return None


def _write(path: Path, data: dict) -> None:
    """Write atomically, readable as the directory is (a shared cache); a failure only costs later processes a
    tune, so it is a warning, not an error after all the timing."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.fchmod(fd, 0o600 | (path.parent.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH)))  # mkstemp makes 0600
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log.warning("cannot write autotune cache file %s (%s); later processes will tune again (set KILN_CACHE_DIR "
                    "to a writable directory)", path, e)


def lookup(family: str, device: torch.device, problem: dict[str, Any], candidates: Sequence[TileConfig]
           ) -> TileConfig | None:  # fmt: skip
    """A tuned tile for this problem if this process or an earlier one tuned it; never tunes."""
    key = problem_key(family, device, problem, candidates)
    if key in _memo:
        return _memo[key]
    best = _read(_path(family, key))
    if best is not None:
        _memo[key] = best
        _stats.loaded += 1
    return best


def tune(
    family: str,
    device: torch.device,
    problem: dict[str, Any],
    candidates: Sequence[TileConfig],
    make_call: Callable[[TileConfig], Callable[[], Any]],
) -> TileConfig:
    """The fastest candidate for `problem` on `device`: from the memo or the disk cache, else timed now.

    make_call(tile) returns a zero-argument launch of the kernel with that tile on tuning inputs; the timer
    (set_timer, default do_bench) times it. A candidate that fails to compile or launch loses; if all fail,
    the first failure is raised as a CodegenError naming the family and problem.
    """
    if not candidates:
        raise CodegenError(f"autotune {family}: no candidate tiles for {problem}")
    found = lookup(family, device, problem, candidates)
    if found is not None:
        return found
    timer = _timer if _timer is not None else cuda_timer
    timings: list[tuple[TileConfig, float]] = []
    first_error: Exception | None = None
    for tile in candidates:
        try:
            ms = float(timer(make_call(tile)))
        except Exception as e:  # out of shared memory / registers on this device: the config simply loses
            first_error = first_error or e
            _stats.failed += 1
            log.info("autotune %s: %s failed on %s: %s", family, tile, device_id(device), e)
            continue
        _stats.timed += 1
        timings.append((tile, ms))
    if not timings:
        raise CodegenError(f"autotune {family}: none of the {len(candidates)} candidate tiles ran on "
                           f"{device_id(device)} for {problem}; first error: {first_error}") from first_error
    best = min(timings, key=lambda t: t[1])[0]
    key = problem_key(family, device, problem, candidates)
    _write(_path(family, key), {
        "format": FORMAT, "family": family, "device": device_id(device), "triton": triton_version(),
        "problem": problem, "best": _tile_dict(best),
        "timings_ms": [{**_tile_dict(t), "ms": ms} for t, ms in timings],
    })  # fmt: skip
    _memo[key] = best
    _stats.tuned += 1
    return best
