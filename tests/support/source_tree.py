"""kiln's source files by module name (the folders pyproject maps to kiln.* packages), for the structure tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# import name prefix -> folder (pyproject's package-dir)
FOLDERS = {"kiln.passes": "passes", "kiln.codegen": "codegen", "kiln.runtime": "runtime", "kiln.specs": "specs",
           "kiln": "compiler"}  # fmt: skip


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for prefix, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if rel.parts[0] == folder:
            parts = [*prefix.split("."), *rel.with_suffix("").parts[1:]]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


def all_sources() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS.values() for p in sorted((ROOT / folder).rglob("*.py"))}


SOURCES = all_sources()


def rel_path(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
