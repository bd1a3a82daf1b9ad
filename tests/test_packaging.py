"""pyproject.toml lists every kiln package and the data files they read: the editable install used in development
finds a folder missing from `packages`, a wheel or `pip install .` would not (`import kiln.build` failed there when
kiln.train was left out)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
SETUP = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk() -> set[str]:
    """Every folder with an __init__.py under a package-dir root, by its import name."""
    found = set()
    for name, folder in SETUP["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in rel and not any(p.startswith(".") for p in rel):
                found.add(".".join([name, *rel]))
    return found


def _root_of(package: str) -> str:
    return max((r for r in SETUP["package-dir"] if package == r or package.startswith(r + ".")), key=len)


def test_every_package_folder_is_listed():
    listed = set(SETUP["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "listed in pyproject.toml but no folder with an __init__.py"


def test_every_data_file_a_package_reads_is_listed():
    data = SETUP["package-data"]
    for package, suffix in (("kiln.spec", ".lark"), ("kiln.specs", ".kiln"), ("kiln.codegen", ".j2")):
        folder = ROOT / SETUP["package-dir"].get(package, _folder(package))
        files = [p.relative_to(folder) for p in folder.rglob(f"*{suffix}")]
        assert files, (package, suffix)
        patterns = data[package]
        for f in files:
            assert any(f.match(pat) for pat in patterns), f"{package}: {f} is not matched by package-data {patterns}"


def _folder(package: str) -> str:
    root = _root_of(package)
    return str(Path(SETUP["package-dir"][root], *package[len(root) + 1 :].split(".")))
