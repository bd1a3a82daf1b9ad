"""Facts written once: the version (compiler/__init__.py, which pyproject.toml reads), the float dtype names
(kiln.model_config.DTYPES), the walk of a dotted parameter name (kiln.ir.attrs.owner) and a step input's numpy dtype
(its StepInput's torch dtype through kiln.runtime.input_batch.numpy_dtype). Read from the source, as
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


def _hand_spelled_numpy(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that spell one of these numpy dtypes by hand: np.<name> / numpy.<name>, or dtype="<name>"."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name) \
                and node.value.id in ("np", "numpy"):
            lines.append(node.lineno)
        if isinstance(node, ast.keyword) and node.arg == "dtype" and isinstance(node.value, ast.Constant) \
                and node.value.value in names:
            lines.append(node.lineno)
    return lines


def _step_input_numpy_names() -> set[str]:
    """The numpy names of STEP_INPUTS' declared dtypes, but int64: numpy's integer for host arithmetic too."""
    from kiln.runtime.input_batch import numpy_dtype  # lazy: loads torch, which the other checks here never need
    from kiln.step import STEP_INPUTS

    return {numpy_dtype(spec.dtype).name for spec in STEP_INPUTS.values() if spec.dtype is not None} - {"int64"}


def test_step_inputs_numpy_dtypes_come_from_their_declaration():
    """The runtime's host mirrors of step inputs (staging views, block-table rows, the routed state) take their dtype
    from the StepInput through kiln.runtime.input_batch.numpy_dtype, the one torch -> numpy mapping: no module spells
    a step input's numpy dtype (np.int32) by hand, and no other maps torch dtypes to numpy (`.numpy().dtype`)."""
    names = _step_input_numpy_names()
    assert names, "STEP_INPUTS declares only int64 inputs: nothing to look for"
    spelled, mapped = [], []
    for module, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        if module.startswith("kiln.runtime"):
            spelled += [f"{rel_path(path)}:{line}" for line in _hand_spelled_numpy(tree, names)]
        if module != "kiln.runtime.input_batch":
            mapped += [f"{rel_path(path)}:{n.lineno}" for n in ast.walk(tree)
                       if isinstance(n, ast.Attribute) and n.attr == "dtype" and isinstance(n.value, ast.Call)
                       and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "numpy"]  # fmt: skip
    assert not spelled, f"take a step input's numpy dtype from STEP_INPUTS via input_batch.numpy_dtype: {spelled}"
    assert not mapped, f"map torch dtypes to numpy with kiln.runtime.input_batch.numpy_dtype: {mapped}"


def test_the_numpy_dtype_check_finds_what_it_replaces():
    """The check is live: it finds the hand-written dtypes runtime/routed_state.py had before."""
    names = _step_input_numpy_names()
    old = "tables = np.full((2, 8, 8), NULL_BLOCK, dtype=np.int32)\nrows = np.zeros(3, dtype='int32')\n"
    assert sorted(_hand_spelled_numpy(ast.parse(old), names)) == [1, 2]
