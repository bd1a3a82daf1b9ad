"""The import graph of the kiln package: dependencies point one way, no cycles, imports at module top.

Read from the source (ast), not from sys.modules, so a lazy import inside a function counts the same as one
at the top. The table below is the one in docs/ARCHITECTURE.md: what each part of kiln may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name prefix -> folder (pyproject's package-dir)
FOLDERS = {"kiln.passes": "passes", "kiln.codegen": "codegen", "kiln.runtime": "runtime", "kiln.specs": "specs",
           "kiln": "compiler"}  # fmt: skip

# Each part and the parts it may import (besides itself). Root modules are parts of their own.
LEAVES = ("kiln.errors", "kiln.env", "kiln.log", "kiln.progress", "kiln.run_info", "kiln.chat_template")
ALLOWED: dict[str, set[str]] = {
    "kiln.errors": set(),
    "kiln.chat_template": {"kiln.errors"},
    "kiln.env": {"kiln.errors"},
    "kiln.log": {"kiln.errors", "kiln.env"},
    "kiln.progress": {"kiln.errors", "kiln.env"},
    "kiln.run_info": set(),
    "kiln.model_config": {*LEAVES},
    "kiln.step": {*LEAVES, "kiln.model_config"},
    "kiln.tokenizer": {*LEAVES, "kiln.step"},
    "kiln.spec": {*LEAVES, "kiln.model_config", "kiln.step"},
    "kiln.quant": {*LEAVES, "kiln.model_config", "kiln.step", "kiln.tokenizer"},
    "kiln.ir": {*LEAVES, "kiln.model_config", "kiln.quant"},
    "kiln.codegen": {*LEAVES},
    "kiln.passes": {*LEAVES, "kiln.model_config", "kiln.step", "kiln.ir", "kiln.quant", "kiln.codegen"},
    "kiln.hf": {*LEAVES, "kiln.model_config", "kiln.step", "kiln.spec", "kiln.tokenizer"},
    "kiln.gguf": {*LEAVES, "kiln.model_config", "kiln.spec", "kiln.tokenizer", "kiln.hf", "kiln.quant", "kiln.ir"},
    "kiln.compile": {*LEAVES, "kiln.model_config", "kiln.step", "kiln.spec", "kiln.quant", "kiln.ir", "kiln.codegen",
                     "kiln.passes", "kiln.hf"},  # fmt: skip
    "kiln.runtime": {*LEAVES, "kiln.step"},
    "kiln.dynamo": {*LEAVES, "kiln.ir", "kiln.passes", "kiln.codegen", "kiln.compile"},
    "kiln.train": {*LEAVES, "kiln.model_config", "kiln.ir"},
}
# The top: the user-facing entry points, which may import any part.
TOP = ("kiln", "kiln.__main__", "kiln.build", "kiln.llm", "kiln.reference", "kiln.speculation", "kiln.cli",
       "kiln.server")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for prefix, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if rel.parts[0] == folder:
            parts = [*prefix.split("."), *rel.with_suffix("").parts[1:]]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS.values() for p in sorted((ROOT / folder).rglob("*.py"))}


SOURCES = _sources()


def _part(module: str) -> str:
    for name in sorted((*ALLOWED, *TOP), key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} belongs to no part in the table: add it to ALLOWED or TOP")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not SOURCES[module].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, *, top_only: bool = False) -> list[tuple[str, int, bool]]:
    """(imported kiln module, line, at module level) for every kiln import in a module."""
    tree = ast.parse(SOURCES[module].read_text())
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
        else:
            continue
        at_top = id(node) in top
        if top_only and not at_top:
            continue
        found += [(n, node.lineno, at_top) for n in names if n == "kiln" or n.startswith("kiln.")]
    return found


def _graph(*, top_only: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    for module in SOURCES:
        g.add_node(module)
        for target, _, _ in _imports(module, top_only=top_only):
            target = target if target in SOURCES else target.rsplit(".", 1)[0]
            if target != module and target in SOURCES:
                g.add_edge(module, target)
    return g


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_every_module_belongs_to_a_part():
    for module in SOURCES:
        _part(module)


def violations(sources: dict[str, Path] | None = None) -> list[str]:
    found = []
    for module in SOURCES if sources is None else sources:
        here = _part(module)
        if here in TOP:
            continue
        for target, line, _ in _imports(module):
            there = _part(target) if target != "kiln" else "kiln"
            if there != here and there not in ALLOWED[here]:
                found.append(f"{_rel(SOURCES[module])}:{line}: {here} may not import {target}")
    return found


def test_imports_point_one_way():
    bad = violations()
    assert not bad, "imports against the layering table (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_part_table_itself_has_no_cycle():
    g = nx.DiGraph([(a, b) for a, deps in ALLOWED.items() for b in deps])
    assert nx.is_directed_acyclic_graph(g), nx.find_cycle(g)


def test_no_import_cycles_between_modules():
    cycles = list(nx.simple_cycles(_graph(top_only=False)))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_imports_inside_functions_say_why():
    """An import inside a function is allowed when a comment on its line, or above its block of imports, says why."""
    bad = []
    for module, path in SOURCES.items():
        lines = path.read_text().splitlines()
        for _, line, at_top in _imports(module):
            if at_top:
                continue
            here, i = lines[line - 1], line - 2
            while i >= 0 and lines[i].strip().startswith(("from ", "import ")):  # a block of imports: one comment
                i -= 1
            if "#" not in here and not (i >= 0 and lines[i].strip().startswith("#")):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here.strip()}")
    assert not bad, "imports inside functions without a comment saying why:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("source, target", [("kiln.passes.kv_cache", "kiln.compile.pipeline"),
                                            ("kiln.runtime.engine", "kiln.model_config"),
                                            ("kiln.ir.ops", "kiln.passes.kv_cache"),
                                            ("kiln.codegen.paged", "kiln.ir.ops_paged")])  # fmt: skip
def test_a_reversed_import_is_caught(tmp_path, monkeypatch, source, target):
    """The check is live: one added import against the table is reported by name."""
    fake = tmp_path / "mod.py"
    fake.write_text(SOURCES[source].read_text() + f"\nimport {target}\n")
    monkeypatch.setitem(SOURCES, source, fake)
    bad = [v for v in violations({source: fake}) if target in v]
    assert bad and f"may not import {target}" in bad[0]


def test_checking_a_spec_does_not_import_torch():
    """`kiln check`, `kiln fmt` and `kiln --help` stay fast: the CLI and the spec language load without torch."""
    import subprocess
    import sys

    code = "import sys, kiln.cli, kiln.spec.loader, kiln.spec.validate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_compiler_does_not_import_triton():
    """Triton reads TRITON_INTERPRET when it is first imported, so only launching a kernel may import it."""
    import subprocess
    import sys

    code = ("import sys, kiln.build, kiln.llm, kiln.cli, kiln.compile.step, kiln.compile.driver, kiln.dynamo.backend; "
            "print('triton' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_environment_variables_are_read_in_kiln_env_only():
    readers = [f"{_rel(path)}:{i}" for module, path in SOURCES.items() if module != "kiln.env"
               for i, line in enumerate(path.read_text().splitlines(), start=1)
               if ("os.environ" in line or "getenv(" in line) and not line.lstrip().startswith("#")]
    assert not readers, f"read environment variables through kiln.env: {readers}"
