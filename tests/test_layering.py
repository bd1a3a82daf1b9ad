"""The import graph of the kiln package: dependencies point one way, no cycles, imports at module top.

Read from the source (ast), not from sys.modules, so a lazy import inside a function counts the same as one
at the top. What each part of kiln may import is read from the table in docs/ARCHITECTURE.md ("Packages and
what each may import"), the one place it is written: a row names its parts in the first column (a package
with everything under it, a root module exactly) and what they may import in the third (`nothing`, or names
after `kiln.`; `kiln` is the package's __init__). A module that no row names fails, so a new root module needs
a row of its own.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from tests.support.source_tree import ROOT, SOURCES, rel_path

DOC = ROOT / "docs" / "ARCHITECTURE.md"
TABLE_HEADING = "## Packages and what each may import"
PART_NAME = re.compile(r"kiln(\.[a-z_]+)?")


def read_table(text: str) -> dict[str, frozenset[str]]:
    """part -> the parts it may import (besides itself), from the doc's table."""
    _, found, section = text.partition(TABLE_HEADING)
    assert found, f"{DOC}: no section {TABLE_HEADING!r}"
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # past the header and its --- line
        if not line.startswith("|"):
            break
        rows.append(line)
    table: dict[str, frozenset[str]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 3, f"{DOC}: a row of the import table needs 3 cells, not {len(cells)}: {row}"
        names = [n.strip() for n in cells[2].split(",")]
        may = frozenset() if names == ["nothing"] else frozenset(n if n == "kiln" else f"kiln.{n}" for n in names)
        for part in (p.strip() for p in cells[0].split(",")):
            assert PART_NAME.fullmatch(part), f"{DOC}: {part!r} is not a part name (kiln or kiln.x) in: {row}"
            assert part not in table, f"{DOC}: {part} has two rows in the import table"
            table[part] = may
    return table


ALLOWED = read_table(DOC.read_text())


def _part(module: str) -> str:
    """The table's part holding `module`: `kiln` holds the package's __init__ only, any other part itself and what
    lies under it."""
    for name in sorted(ALLOWED, key=len, reverse=True):
        if module == name or (name != "kiln" and module.startswith(name + ".")):
            return name
    raise AssertionError(f"{module} belongs to no part: give it a row in the import table of docs/ARCHITECTURE.md")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not SOURCES[module].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _top_level(tree: ast.Module) -> set[int]:
    """The statements that run when the module is imported (the body, and the bodies of its top-level ifs)."""
    return {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}


def _imports(module: str, *, top_only: bool = False) -> list[tuple[str, int, bool]]:
    """(imported kiln module, line, at module level) for every kiln import in a module."""
    tree = ast.parse(SOURCES[module].read_text())
    top = _top_level(tree)
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


def test_every_module_belongs_to_a_part():
    for module in SOURCES:
        _part(module)


def test_a_new_root_module_needs_a_row_of_its_own(tmp_path, monkeypatch):
    """`kiln` holds its __init__ only: a root module the table does not name is not let through as part of it."""
    fake = tmp_path / "new_root.py"
    fake.write_text("import kiln.cli\n")
    monkeypatch.setitem(SOURCES, "kiln.new_root", fake)
    with pytest.raises(AssertionError, match="kiln.new_root belongs to no part"):
        test_every_module_belongs_to_a_part()


def test_every_part_in_the_table_exists():
    """A row names modules that exist, and allows only parts that have rows (no stale kiln.log)."""
    absent = [p for p in ALLOWED if not any(_part(m) == p for m in SOURCES)]
    assert not absent, f"rows of the import table in {rel_path(DOC)} for parts with no module: {absent}"
    unknown = sorted({f"{p} -> {d}" for p, deps in ALLOWED.items() for d in deps if d not in ALLOWED})
    assert not unknown, f"the import table in {rel_path(DOC)} allows parts it has no row for: {unknown}"


def violations(sources: dict[str, Path] | None = None) -> list[str]:
    found = []
    for module in SOURCES if sources is None else sources:
        here = _part(module)
        for target, line, _ in _imports(module):
            there = _part(target)
            if there != here and there not in ALLOWED[here]:
                found.append(f"{rel_path(SOURCES[module])}:{line}: {here} may not import {target}")
    return found


def test_imports_point_one_way():
    bad = violations()
    assert not bad, f"imports against the layering table ({rel_path(DOC)}):\n" + "\n".join(bad)


def test_the_part_table_itself_has_no_cycle():
    g = nx.DiGraph([(a, b) for a, deps in ALLOWED.items() for b in deps])
    assert nx.is_directed_acyclic_graph(g), nx.find_cycle(g)


def test_no_import_cycles_between_modules():
    cycles = list(nx.simple_cycles(_graph(top_only=False)))
    assert not cycles, f"import cycles: {cycles[:5]}"


def _lazy_reason(lines: list[str], line: int) -> str:
    """The comment saying why an import sits in a function: on its line, or above its block of imports."""
    here, i = lines[line - 1], line - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):  # a block of imports: one comment
        i -= 1
    if "#" in here:
        return here.split("#", 1)[1]
    return lines[i].strip() if i >= 0 and lines[i].strip().startswith("#") else ""


def test_imports_inside_functions_say_why():
    """An import inside a function is allowed when a comment on its line, or above its block of imports, says why."""
    bad = []
    for module, path in SOURCES.items():
        lines = path.read_text().splitlines()
        for _, line, at_top in _imports(module):
            if not at_top and not _lazy_reason(lines, line):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {lines[line - 1].strip()}")
    assert not bad, "imports inside functions without a comment saying why:\n" + "\n".join(sorted(set(bad)))


@functools.cache
def _top_level_facts(module: str, path: Path) -> tuple[bool, tuple[str, ...]]:
    """(whether `module` imports torch at top level, the kiln modules it imports at top level)."""
    tree = ast.parse(path.read_text())
    top = _top_level(tree)
    torch = any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names)
                or isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch"
                for n in ast.walk(tree) if id(n) in top)  # fmt: skip
    kiln = tuple(t if t in SOURCES else t.rsplit(".", 1)[0] for t, _, _ in _imports(module, top_only=True))
    return torch, kiln


def _loads_torch(module: str) -> bool:
    """Whether importing `module` imports torch: it, a package above it, or a kiln module that any of these imports
    at top level (and so on) has `import torch` / `from torch ...` at top level."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or name not in SOURCES:
            continue
        seen.add(name)
        torch, kiln = _top_level_facts(name, SOURCES[name])
        if torch:
            return True
        todo += [*kiln, *(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))]
    return False


def test_lazy_imports_for_torch_say_true():
    """An import kept inside a function because it "loads torch" must load torch, and its module must not load torch
    already (then the import belongs at the top)."""
    bad = []
    for module, path in SOURCES.items():
        lines = path.read_text().splitlines()
        for target, line, at_top in _imports(module):
            target = target if target in SOURCES else target.rsplit(".", 1)[0]
            if at_top or "loads torch" not in _lazy_reason(lines, line):
                continue
            if _loads_torch(module):
                bad.append(f"{rel_path(path)}:{line}: {module} loads torch itself: import {target} at the top")
            elif not _loads_torch(target):
                bad.append(f"{rel_path(path)}:{line}: {target} does not load torch: import it at the top")
    assert not bad, "lazy imports whose comment says they load torch:\n" + "\n".join(sorted(set(bad)))


def test_the_torch_check_agrees_with_python():
    """_loads_torch, read from the source, against a fresh interpreter: modules without torch, then one with it
    (imported last, since a module imported after torch would read as loading it)."""
    modules = ["kiln.cli.commands", "kiln.cli.perplexity_parser", "kiln.gguf.files", "kiln.quant.sizing",
               "kiln.cli.perplexity"]
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "    print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(_loads_torch(m)) for m in modules] == ["False"] * 4 + ["True"]


@pytest.mark.parametrize("source, target", [("kiln.passes.kv_cache", "kiln.compile.pipeline"),
                                            ("kiln.runtime.engine", "kiln.model_config"),
                                            ("kiln.runtime.engine", "kiln.server"),
                                            ("kiln.runtime.engine", "kiln.env"),
                                            ("kiln.codegen.paged", "kiln.progress"),
                                            ("kiln.llm_prompts", "kiln.cli"),
                                            ("kiln.ir.ops", "kiln.passes.kv_cache"),
                                            ("kiln.codegen.paged", "kiln.ir.ops_paged")])  # fmt: skip
def test_a_reversed_import_is_caught(tmp_path, monkeypatch, source, target):
    """The check is live: one added import against the table is reported by name."""
    fake = tmp_path / "mod.py"
    fake.write_text(SOURCES[source].read_text() + f"\nimport {target}\n")
    monkeypatch.setitem(SOURCES, source, fake)
    bad = [v for v in violations({source: fake}) if target in v]
    assert bad and f"may not import {target}" in bad[0]


SPEC = str(ROOT / "specs" / "tiny-llama.kiln")


@pytest.mark.parametrize("argv", [["check", SPEC], ["fmt", SPEC], ["fmt", "--check", SPEC], ["--help"],
                                  ["bench", "perplexity", "--help"]], ids=" ".join)  # fmt: skip
def test_spec_commands_and_help_do_not_import_torch(argv):
    """`kiln check`, `kiln fmt` and `kiln --help` stay fast: the whole command, parser included, runs without torch."""
    code = ("import sys\nfrom kiln.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint(rc, 'torch' in sys.modules, file=sys.stderr)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines()[-1] == "0 False", out.stderr


def test_the_spec_language_does_not_import_torch():
    code = "import sys, kiln.cli, kiln.spec.loader, kiln.spec.validate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_compiler_does_not_import_triton():
    """Triton reads TRITON_INTERPRET when it is first imported, so only launching a kernel may import it."""
    code = ("import sys, kiln.build, kiln.llm, kiln.cli, kiln.compile.step, kiln.compile.driver, kiln.dynamo.backend; "
            "print('triton' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_environment_variables_are_read_in_kiln_env_only():
    readers = [f"{rel_path(path)}:{i}" for module, path in SOURCES.items() if module != "kiln.env"
               for i, line in enumerate(path.read_text().splitlines(), start=1)
               if ("os.environ" in line or "getenv(" in line) and not line.lstrip().startswith("#")]
    assert not readers, f"read environment variables through kiln.env: {readers}"


def _test_imports(path: Path) -> list[str]:
    """The modules a test file imports from the tests package, with relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found += [module] if module != base or not node.level else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [m for m in found if m == "tests" or m.startswith("tests.")]


def test_tests_share_helpers_through_tests_support_only():
    """A helper another test file (or a conftest.py) needs lives in tests.support: importing a test module runs its
    module-level code, and a hypothesis TestCase or fixture it defines can be collected or shadowed twice."""
    test_files = sorted([*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "tests").rglob("conftest.py")])
    wrong = {rel_path(p): m for p in test_files for m in _test_imports(p)
             if not (m == "tests.support" or m.startswith("tests.support."))}  # fmt: skip
    assert not wrong, wrong
    assert not sorted((ROOT / "tests" / "support").glob("test_*.py")), "tests.support holds helpers, not tests"
