"""The `kiln` subcommands' files: an input file a flag names checked before any work, output files and
directories checked before any work (they exist or can be made, and take new files), and output written whole or
not at all (write_file_atomic, staged_dir)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.errors import UsageError


def check_input_file(flag: str, path: str | None) -> None:
    """Check before any work that the file a flag names can be read (None: the flag was not given)."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file; check the path")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: is not a regular file; give a text file")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read ({e.strerror or e}); check its permissions") from None


def _writable_dir(flag: str, path: str, directory: Path) -> None:
    """Raise a UsageError naming `flag` unless `directory` exists, is a directory and takes new files."""
    if not directory.exists():
        raise UsageError(f"{flag} {path}: the directory {directory} does not exist; create it first "
                        f"(mkdir -p {directory}) or choose another place")
    if not directory.is_dir():
        raise UsageError(f"{flag} {path}: {directory} is a file, not a directory; choose a path inside a directory")
    try:  # a real probe: permission bits say nothing for root, or on a read-only mount
        fd, probe = tempfile.mkstemp(prefix=".kiln-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {directory} ({e.strerror or e}); choose a writable "
                        "place") from None


def check_output_file(flag: str, path: str, example: str = "model.kiln") -> Path:
    """Check before any work that `path` can be written as a file; returns it as a Path. `example`: a file name the
    command writes, for the hint when `path` is a directory."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {flag} {p / example}")
    _writable_dir(flag, path, p.parent)
    return p


def check_output_dir(flag: str, path: str) -> Path:
    """Check before any work that `path` is (or can be made, one level deep) a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a directory; give a new or existing directory")
    _writable_dir(flag, path, p if p.is_dir() else p.parent)
    return p


def write_file_atomic(flag: str, path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary file beside it, then a rename."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise UsageError(f"{flag} {path}: cannot write ({e.strerror or e}); choose a writable place") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _as_created(path: Path) -> None:
    """Give `path` the mode open() / mkdir() would have given it under the umask: tempfile's mkstemp / mkdtemp (and
    safetensors' save_file) make private 0600 / 0700 ones, which another user (a server's) could not read."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


@contextmanager
def staged_file(flag: str, path: Path) -> Iterator[Path]:
    """A temporary file name beside `path` to write to (a writer that takes a path: safetensors' save_file); on
    success it replaces `path` with the umask's mode, on failure it is removed: `path` is never half-written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    stage = Path(tmp)
    try:
        yield stage
        _as_created(stage)
        os.replace(stage, path)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write ({e.strerror or e}); choose a writable place") from None
    finally:
        stage.unlink(missing_ok=True)


@contextmanager
def staged_dir(flag: str, path: Path) -> Iterator[Path]:
    """A temporary directory beside `path` to write into; on success its files move into `path` (created if
    missing), on failure it is removed, so `path` never holds a half-written result."""
    stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield stage
        for item in [stage, *stage.rglob("*")]:
            _as_created(item)
        if not path.exists():
            os.replace(stage, path)
            return
        for item in sorted(stage.rglob("*")):
            target = path / item.relative_to(stage)
            if item.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(item, target)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write ({e.strerror or e}); choose a writable place") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
