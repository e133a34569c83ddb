"""The import graph of our packages, read from the source with `ast`: no file-level cycles, and imports flow one way
(`mmserve` -> `cache` -> `visual`/`language`; nothing below `mmserve/` imports it).

Every import statement counts, wherever it sits: a function-local import or one under `if TYPE_CHECKING:` is how a
cycle gets hidden, and it still ties the two files together (whoever changes one has to read the other)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mmserve", "visual", "language", "cache", "families")
# package -> top-level packages of ours it must never import
FORBIDDEN = {
    "language": {"mmserve"},
    "visual": {"mmserve"},
    "cache": {"mmserve"},
    "families": {"mmserve", "language", "visual", "cache"},
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under PACKAGES (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path, is_package: bool) -> Iterator[tuple[str, int]]:
    """Each (dotted name, line) that a file imports, anywhere in it. `from m import x` gives m.x when that is a
    module (a submodule imported by name) and m otherwise (x is an attribute of m)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                anchor = here[: len(here) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of ours that `name` (a module, or a module's attribute) lies in."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """module -> modules of ours it imports, and the line of the first import of each edge."""
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lines: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for name, line in imported_names(module, path, is_package):
            target = resolve(name, modules)
            if target is None or target == module:
                continue
            graph[module].add(target)
            lines.setdefault((module, target), line)
    return graph, lines


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (or a self-loop): the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0

    def visit(root: str) -> None:
        # iterative, so that a deep chain cannot hit Python's recursion limit
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def describe(component: list[str], graph: dict[str, set[str]], lines: dict[tuple[str, str], int]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b} (line {lines[(a, b)]})" for a in component for b in sorted(graph[a] & members)]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_tarjan_finds_a_cycle_and_nothing_else() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["e"]]


def test_local_relative_and_type_checking_imports_are_edges(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .sub import thing\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.typed import T\n"
        "def f():\n"
        "    import pkg.local.deep\n"
    )
    names = {name for name, _ in imported_names("pkg.m", source, is_package=False)}
    assert {"pkg.sibling", "pkg.sub.thing", "pkg.typed.T", "pkg.local.deep"} <= names
    modules = dict.fromkeys(["pkg", "pkg.sub", "pkg.typed", "pkg.local"], source)
    assert resolve("pkg.sub.thing", modules) == "pkg.sub"
    assert resolve("pkg.local.deep", modules) == "pkg.local"
    assert resolve("typing.TYPE_CHECKING", modules) is None


def test_no_import_cycles() -> None:
    graph, lines = import_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles between files:\n" + "\n".join(describe(c, graph, lines) for c in cycles)


def test_imports_flow_one_way() -> None:
    graph, lines = import_graph()
    wrong = [
        f"{module} imports {target} (line {lines[(module, target)]})"
        for module, targets in graph.items()
        for target in sorted(targets)
        if target.split(".")[0] in FORBIDDEN.get(module.split(".")[0], set())
    ]
    assert not wrong, "imports against the package rule:\n" + "\n".join(wrong)


def top_level_imports(directory: Path) -> Iterator[tuple[Path, str, int]]:
    """(file, top-level package, line) for every import in every .py under `directory`."""
    for path in sorted(directory.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for name, line in imported_names(module, path, path.name == "__init__.py"):
            yield path, name.split(".")[0], line


def test_tests_and_benchmarks_do_not_import_each_other() -> None:
    """What both need (checkpoint builders, the server harness, test images) lives in mmserve/testing/. Only the
    tests of the benchmark scripts' own logic (tests/unit/benchmarks/) import benchmarks/."""
    allowed = ROOT / "tests" / "unit" / "benchmarks"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {package}"
        for directory, package in ((ROOT / "benchmarks", "tests"), (ROOT / "tests", "benchmarks"))
        for path, imported, line in top_level_imports(directory)
        if imported == package and allowed not in path.parents
    ]
    assert not wrong, "\n".join(wrong)
