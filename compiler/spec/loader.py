"""Load a spec from a .kiln path or by the name of a bundled spec (package kiln.specs): parse, then resolve."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from kiln.errors import KilnError
from kiln.model_config import CompileConfig, ModelConfig
from kiln.spec.ast import SpecFile
from kiln.spec.parser import parse_spec
from kiln.spec.validate import resolve

DEFAULT_SPEC = "tiny-llama"
_SUFFIX = ".kiln"


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


def load_spec(ref: str | os.PathLike) -> LoadedSpec:
    """Load `ref`: a path to a .kiln file, or a bundled spec name such as "tiny-llama" (an existing file wins)."""
    path = Path(ref)
    if path.is_file():
        return parse_and_resolve(path.read_text(encoding="utf-8"), str(path))
    name = str(ref)
    if name.endswith(_SUFFIX) and os.sep not in name:
        name = name[: -len(_SUFFIX)]
    if name in bundled_specs():
        res = files("kiln.specs").joinpath(name + _SUFFIX)
        return parse_and_resolve(res.read_text(encoding="utf-8"), str(res))
    raise KilnError(f"{ref}: no such spec file or bundled spec; bundled specs are: {', '.join(bundled_specs())}")
