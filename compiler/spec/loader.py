"""Load a spec from a .kiln path or by the name of a bundled spec (package kiln.specs): parse, then resolve."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from kiln.errors import Diagnostic, SpecError, UsageError
from kiln.model_config import CompileConfig, ModelConfig
from kiln.spec.ast import SpecFile
from kiln.spec.parser import parse_spec
from kiln.spec.validate import resolve

DEFAULT_SPEC = "tiny-llama"
_SUFFIX = ".kiln"
MAX_SPEC_BYTES = 16 << 20  # specs are a few hundred bytes; this stops a checkpoint given by mistake being read


@dataclass
class LoadedSpec:
    ast: SpecFile
    model: ModelConfig
    compile: CompileConfig
    path: str


def bundled_specs() -> list[str]:
    """Names of the specs shipped in kiln.specs, sorted."""
    return sorted(p.name[: -len(_SUFFIX)] for p in files("kiln.specs").iterdir() if p.name.endswith(_SUFFIX))


def parse_and_resolve(text: str, path: str = "<spec>") -> LoadedSpec:
    """Parse and validate spec source text; raises SpecError listing every problem."""
    ast = parse_spec(text, path)
    model, compile_config = resolve(ast)
    return LoadedSpec(ast=ast, model=model, compile=compile_config, path=path)


def read_spec_file(path: Path) -> str:
    """The text of a spec file; an unreadable file is a UsageError, one that is not UTF-8 a SpecError at the
    first bad byte (a binary file given by mistake, or a legacy encoding)."""
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise UsageError(f"{path}: {size / 2**20:.0f} MiB is far too large for a spec file (at most "
                            f"{MAX_SPEC_BYTES >> 20} MiB); pass the .kiln text file, not a checkpoint")
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read the spec file: {e.strerror or e}; check the path and its "
                        "permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        binary = b"\0" in data[:4096]
        hint = ("this looks like a binary file, not a spec: pass the .kiln text file" if binary else
                "save the file as UTF-8 (specs are UTF-8 text)")
        raise SpecError([Diagnostic(str(path), line, col, f"not UTF-8 text: byte 0x{data[e.start]:02x} at byte "
                                    f"offset {e.start} cannot be decoded", hint)]) from None


def load_spec(ref: str | os.PathLike) -> LoadedSpec:
    """Load `ref`: a path to a .kiln file, or a bundled spec name such as "tiny-llama" (an existing file wins)."""
    path = Path(ref)
    if path.is_file():
        return parse_and_resolve(read_spec_file(path), str(path))
    if path.is_dir():
        raise UsageError(f"{ref}: is a directory, not a spec file; pass a .kiln file or a bundled spec name")
    res = bundled_spec(ref)
    if res is not None:
        return parse_and_resolve(res.read_text(encoding="utf-8"), str(res))
    raise UsageError(f"{ref}: no such spec file or bundled spec; bundled specs are: {', '.join(bundled_specs())}")


def bundled_spec(ref: str | os.PathLike) -> Traversable | None:
    """The bundled spec that `ref` names ("tiny-llama" or "tiny-llama.kiln"), or None."""
    name = str(ref)
    if name.endswith(_SUFFIX) and os.sep not in name:
        name = name[: -len(_SUFFIX)]
    return files("kiln.specs").joinpath(name + _SUFFIX) if name in bundled_specs() else None
