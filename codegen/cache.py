"""The kernel cache: a kernel request -> rendered Triton source in a .py file on disk -> a @triton.jit function.

The key hashes the request (template text, kernel name, parameters) with triton's version and CODEGEN_VERSION,
so editing a template or upgrading either invalidates old files, and a later process that finds the file
imports it without rendering. Files live under KILN_CACHE_DIR (default ~/.cache/kiln/kernels) as readable
Python, one module per key; @triton.jit needs a real file because it reads its own source with inspect.
An in-process memo means a repeated request neither renders nor imports again. Compiled binaries are
cached by triton itself (keyed by the source), so a cache hit here also compiles nothing.

Hygiene: every file ends with a checksum line over the source above it, so a truncated or corrupted file is
detected, rendered again and replaced (with a warning on the `kiln` logger); `*.tmp` files older than
STALE_TMP_S (left by a writer that was killed) are removed when a cache first touches its directory; files
take the directory's group/other read bits, so a group-shared cache directory stays shared.
Triton is imported lazily so importing this module never fixes the
TRITON_INTERPRET setting too early.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln import env
from kiln.codegen.render import _SUFFIX, render, template_names, template_sources
from kiln.errors import CodegenError

# Bump when templates or the cache layout change in a way the source hash would not catch.
CODEGEN_VERSION = "2"  # 2: files end with a checksum line
STALE_TMP_S = 600.0  # a writer takes milliseconds; a temp file this old belongs to a killed process
_CHECK_PREFIX = "# kiln-cache-sha256: "

log = logging.getLogger("kiln.cache")


def default_cache_dir() -> Path:
    return env.cache_dir()


def triton_version() -> str:
    import triton

    return triton.__version__


def kernel_key(template: str, name: str, params: dict[str, Any], triton_ver: str | None = None) -> str:
    """Key of a kernel request: sha256 over codegen version, triton version, the text of the template and of every
    file it includes, name and params."""
    ver = triton_version() if triton_ver is None else triton_ver
    try:
        texts = template_sources(template)
    except OSError:
        raise CodegenError(f"unknown kernel template {template!r}; templates: {', '.join(template_names())}") from None
    h = hashlib.sha256()
    for part in (CODEGEN_VERSION, ver, *texts, name, repr(_freeze(params))):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@dataclass
class CacheStats:
    hits: int = 0  # requests answered without rendering (in-process memo, or a file a previous process wrote)
    misses: int = 0  # requests that had to render (a repaired file included)
    renders: int = 0
    imports: int = 0  # modules imported (once per key per process)
    disk_writes: int = 0  # files written (absent from the disk cache before)
    repaired: int = 0  # corrupt files found on disk and written again
    stale_tmp_removed: int = 0  # orphaned temporary files removed


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class KernelCache:
    """Renders, writes and imports kernels once; `load` returns the jitted function."""

    def __init__(self, root: Path | str | None = None):
        self._root = Path(root) if root is not None else None
        self._by_request: dict[Any, Any] = {}
        self._swept: set[Path] = set()
        self.stats = CacheStats()

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else default_cache_dir()

    def load(self, template: str, name: str, **params: Any) -> Any:
        request = (template, name, _freeze(params))
        fn = self._by_request.get(request)
        if fn is not None:
            self.stats.hits += 1
            return fn
        family = template.removesuffix(_SUFFIX)
        path = self.path_for(family, kernel_key(template, name, params))
        self._sweep(path.parent)
        if _intact(path):
            self.stats.hits += 1
        else:
            if path.exists():
                log.warning("kernel cache file %s is corrupt (truncated or edited); rendering it again", path)
                self.stats.repaired += 1
            self.stats.misses += 1
            self._write(path, render(template, name=name, **params))
            self.stats.renders += 1
        fn = getattr(self._import(path), name, None)
        if fn is None:
            raise CodegenError(f"kernel file {path} (template {template!r}) defines no kernel named {name!r}")
        self._by_request[request] = fn
        return fn

    def _sweep(self, directory: Path) -> None:
        """Once per directory: remove temporary files a killed writer left (young ones may be in flight)."""
        if directory in self._swept:
            return
        self._swept.add(directory)
        now = time.time()
        try:
            tmps = list(directory.glob("*.tmp"))
        except OSError:
            return
        removed = 0
        for tmp in tmps:
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
                    removed += 1
            except OSError:  # another process removed or replaced it first
                continue
        self.stats.stale_tmp_removed += removed
        if removed:
            log.info("removed %d stale temporary files from %s", removed, directory)

    def path_for(self, family: str, key: str) -> Path:
        return self.root / f"{family}_{key}.py"

    def _import(self, path: Path) -> ModuleType:
        mod_name = f"kiln_kernel_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # inspect (used by @triton.jit) looks modules up here
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise CodegenError(f"generated kernel {path} failed to import: {type(e).__name__}: {e}; "
                               "delete it to have it rendered again") from e
        self.stats.imports += 1
        return module

    def _write(self, path: Path, source: str) -> None:
        # tmp file + os.replace: a concurrent reader sees the old file or the whole new one, never half.
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
            # mkstemp makes 0600; give the file the directory's read bits so a shared cache stays readable.
            os.fchmod(fd, 0o600 | (path.parent.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH)))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(_with_checksum(source))
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            raise CodegenError(
                f"cannot write kernel cache file {path}: {e}; set KILN_CACHE_DIR to a writable dir"
            ) from e
        self.stats.disk_writes += 1


def _with_checksum(source: str) -> str:
    body = source if source.endswith("\n") else source + "\n"
    return f"{body}{_CHECK_PREFIX}{hashlib.sha256(body.encode()).hexdigest()}\n"


def _intact(path: Path) -> bool:
    """True when `path` exists and its checksum line matches the source above it."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    body, sep, last = data.rstrip(b"\n").rpartition(b"\n")
    if not sep or not last.startswith(_CHECK_PREFIX.encode()):
        return False
    return hashlib.sha256(body + b"\n").hexdigest().encode() == last[len(_CHECK_PREFIX):]


_default: KernelCache | None = None


def default_cache() -> KernelCache:
    global _default
    if _default is None:
        _default = KernelCache()
    return _default


def load_kernel(template: str, name: str, **params: Any) -> Any:
    """The @triton.jit function `name` from `template` rendered with `params`, through the default cache."""
    return default_cache().load(template, name, **params)


def cache_stats() -> CacheStats:
    """Counters of the default cache (a live object)."""
    return default_cache().stats
