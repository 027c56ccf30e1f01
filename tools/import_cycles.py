"""Fail on an import cycle between the modules of a package.

Usage: ``python tools/import_cycles.py [--runtime-only] PACKAGE_DIR...`` (package
directories). Builds the graph of imports between each package's own modules with the standard
library's ``ast``, including imports inside functions (they still run, only later) and, unless
``--runtime-only``, imports under ``if TYPE_CHECKING:``: two modules that name each other only
for type hints still cannot be read, tested or moved alone. Prints each cycle and exits 1 when
there is one, 0 otherwise.

An import edge points at the most specific module it names: ``from pkg.sub import name`` is an
edge to ``pkg.sub.name`` when that is a module, to ``pkg.sub`` otherwise.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path


def _distribution_root(package: Path) -> Path:
    """The directory dotted names start from: the nearest ancestor with a ``pyproject.toml``
    (so a namespace package such as ``llama_index/llms/ragblend`` gets its full name), else the
    package's parent."""
    for ancestor in package.parents:
        if (ancestor / "pyproject.toml").is_file():
            return ancestor
    return package.parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name."""
    root = package_dir.resolve()
    base = _distribution_root(root)
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node``; those under ``if TYPE_CHECKING:`` (never run)
    only with ``type_checking``."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_of(other, type_checking)
            continue
        yield from _imports_of(child, type_checking)


def _imports_of(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node, type_checking)


def _base_of(name: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = name.split(".")
    package = parts if is_package else parts[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def import_graph(package_dir: Path, type_checking: bool = True) -> dict[str, set[str]]:
    """Module → the package's modules it names in an import (at run time only, without
    ``type_checking``)."""
    modules = module_files(package_dir)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets: set[str] = set()
        for node in _imports(tree, type_checking):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                base = _base_of(name, node, path.name == "__init__.py")
                candidates = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for candidate in candidates:
                while candidate and candidate not in modules:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError("a strongly connected component always has a cycle")


def find_cycles(package_dir: Path, type_checking: bool = True) -> list[list[str]]:
    """One shortest cycle per group of mutually importing modules, as module paths
    ``[a, b, ..., a]``; empty when the package has no import cycle."""
    graph = import_graph(package_dir, type_checking)
    return [shortest_cycle(graph, c) for c in strongly_connected(graph)]


def main(argv: list[str]) -> int:
    type_checking = "--runtime-only" not in argv
    packages = [arg for arg in argv if arg != "--runtime-only"]
    if not packages or not all(Path(p, "__init__.py").is_file() for p in packages):
        print(
            "usage: python tools/import_cycles.py [--runtime-only] PACKAGE_DIR...", file=sys.stderr
        )
        return 2
    failed = False
    for package in packages:
        cycles = find_cycles(Path(package), type_checking)
        for cycle in cycles:
            print("import cycle: " + " -> ".join(cycle))
        if not cycles:
            print(f"{package}: no import cycles")
        failed = failed or bool(cycles)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
