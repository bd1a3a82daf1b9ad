"""Facts written once: the version (compiler/__init__.py, which pyproject.toml reads), the float dtype names
(kiln.model_config.DTYPES) and the walk of a dotted parameter name (kiln.ir.attrs.owner). Read from the source, as
tests/test_layering.py reads imports."""

from __future__ import annotations

import ast
import re

import pytest

import kiln
from kiln.model_config import DTYPES
from tests.support.source_tree import ROOT, SOURCES, rel_path

tomllib = pytest.importorskip("tomllib")  # python >= 3.11


def test_the_version_is_written_in_the_package_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml: take the version from kiln.__version__ (dynamic)"
    assert "version" in project["project"].get("dynamic", [])
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kiln.__version__"}
    written = re.findall(r'^__version__ = "([^"]+)"$', (ROOT / "compiler" / "__init__.py").read_text(), re.M)
    assert written == [kiln.__version__]  # a plain literal: setuptools reads it without importing kiln


def test_the_float_dtype_names_are_listed_in_model_config_only():
    """A tuple, list or set of every name in DTYPES outside kiln.model_config is a copy that can drift from it."""
    copies = []
    for module, path in SOURCES.items():
        if module == "kiln.model_config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if set(DTYPES) <= names:
                    copies.append(f"{rel_path(path)}:{node.lineno}")
    assert not copies, f"use kiln.model_config.DTYPES instead of a copy of its names: {copies}"


def _walks_a_dotted_name(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A loop calling getattr(x, part) over the parts of a name split at dots (or functools.reduce(getattr, ...))."""
    splits = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr in ("split", "rsplit") and n.args and isinstance(n.args[0], ast.Constant)
              and n.args[0].value == "."]  # fmt: skip
    if not splits:
        return False
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reduce":
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "getattr":
                return True
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            part = node.target.id
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "getattr"
                        and len(call.args) >= 2 and isinstance(call.args[1], ast.Name) and call.args[1].id == part):
                    return True
    return False


def test_dotted_names_are_walked_in_kiln_ir_attrs_only():
    walks = [f"{rel_path(path)}:{f.lineno} {f.name}" for module, path in SOURCES.items() if module != "kiln.ir.attrs"
             for f in ast.walk(ast.parse(path.read_text()))
             if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _walks_a_dotted_name(f)]
    assert not walks, f"walk dotted names with kiln.ir.attrs (owner, get_tensor, set_tensor): {walks}"


def test_the_walk_check_finds_the_walk_it_replaces():
    """The check is live: kiln.ir.attrs.owner itself is such a walk."""
    tree = ast.parse(SOURCES["kiln.ir.attrs"].read_text())
    owner = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "owner")
    assert _walks_a_dotted_name(owner)
