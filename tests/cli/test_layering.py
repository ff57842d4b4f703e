"""The import layering of the package, read from the source (every import, lazy ones included):

- dlmrt.core imports nothing else of dlmrt;
- the model families (dlmrt.models) import nothing of the runtime;
- the runtime imports nothing of the commands on top of it (cli, serve, bench, eval, orl), and no particular
  family's module: it reaches a family through the Denoiser interface and the FAMILIES registry;
- no two modules import each other, directly or through others, and no two layers do;
- no source file is over 500 lines, and every folder of code is under dlmrt/ (beside the tests and scripts);
- the layers are dlmrt's subpackages, with one split: the engine build pipeline (`dlmrt.engines.build` and
  `dlmrt.quant`, which calibrates by running the model through the runtime) sits above the runtime, and
  the engine store it writes (`dlmrt.engines`: targets, plans, manifests, selection) below it, where the
  TensorRT backend reads it.

Imports made only for type checking (`if TYPE_CHECKING:`) are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dlmrt.models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
TOP = ("dlmrt.cli", "dlmrt.serve", "dlmrt.bench", "dlmrt.eval", "dlmrt.orl")


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    found = {}
    for path in (ROOT / "dlmrt").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The dlmrt modules `name` imports, anywhere in its body (a `from x import y` of a submodule counts y alone)."""
    imported = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                parents = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            named = {f"{base}.{alias.name}" for alias in node.names}
            imported.update(named)
            if not named <= MODULES.keys():  # `from package import submodule` needs only the submodule's own layer
                imported.add(base)
    return {module for module in imported if module in MODULES and module != name}


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                stack.extend(child.orelse)
            else:
                stack.append(child)


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(importers: str, forbidden) -> list[str]:
    return sorted(f"{name} imports {target}" for name, targets in GRAPH.items() if _within(name, importers)
                  for target in targets if forbidden(target))


def test_core_imports_nothing_else_of_dlmrt():
    assert _violations("dlmrt.core", lambda target: not _within(target, "dlmrt.core")) == []


def test_the_model_families_import_nothing_of_the_runtime():
    assert _violations("dlmrt.models", lambda target: _within(target, "dlmrt.runtime")) == []


def test_the_runtime_imports_no_command_on_top_of_it():
    assert _violations("dlmrt.runtime", lambda target: any(_within(target, top) for top in TOP)) == []


def test_the_runtime_imports_no_particular_family():
    families = {family.model_class.__module__ for family in FAMILIES.values()}
    assert families, "FAMILIES names no model class"
    assert _violations("dlmrt.runtime", lambda target: target in families) == []


BUILD_PIPELINE = ("dlmrt.engines.build", "dlmrt.quant")


def _package(module: str) -> str:
    """The layer a module belongs to: one of dlmrt's subpackages."""
    if any(_within(module, stage) for stage in BUILD_PIPELINE):
        return "dlmrt.engines (build pipeline)"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_two_packages_import_each_other():
    edges: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        for target in targets:
            if _package(target) != _package(name):
                edges.setdefault(_package(name), set()).add(_package(target))
    cycles = []
    for start in edges:  # a path from start back to itself
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


@pytest.mark.parametrize("rule", ["dlmrt.core", "dlmrt.models", "dlmrt.runtime"])
def test_the_rules_see_the_modules_they_hold(rule):
    """A rule over no module would pass whatever the code did."""
    assert any(_within(name, rule) for name in MODULES)


def _import_cycles() -> list[list[str]]:
    """The module cycles of GRAPH: its strongly connected components of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                cycles.append(sorted([module, *component]))

    for module in GRAPH:
        if module not in order:
            visit(module)
    return cycles


def test_no_two_modules_import_each_other():
    assert _import_cycles() == []


def test_the_cycle_finder_sees_a_cycle(monkeypatch):
    """A finder that never found a cycle would pass any tree."""
    monkeypatch.setitem(GRAPH, "dlmrt.core.errors", GRAPH["dlmrt.core.errors"] | {"dlmrt.core.atomic"})
    monkeypatch.setitem(GRAPH, "dlmrt.core.atomic", GRAPH["dlmrt.core.atomic"] | {"dlmrt.core.errors"})
    assert ["dlmrt.core.atomic", "dlmrt.core.errors"] in _import_cycles()


MAX_LINES = 500


def test_no_source_file_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): lines for path in MODULES.values()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_folder_of_code_is_under_dlmrt():
    """Outside the package only the tests and the scripts hold Python."""
    holding = {folder.name for folder in ROOT.iterdir()
               if folder.is_dir() and not folder.name.startswith(".") and any(folder.rglob("*.py"))}
    assert holding <= {"dlmrt", "tests", "scripts"}
