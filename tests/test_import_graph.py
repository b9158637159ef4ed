"""The project's import graph, read from the source with `ast` (nothing is imported): no import
circles between modules, the library (agentrl/) imports neither the benchmarks (bench/) nor the
tests, and no benchmark or test double lives inside the library.

Every `import` and `from ... import` that runs counts, at module level and inside functions alike:
a circle that only a function-level import keeps from failing at import time is still a circle
(each side knows the other). Imports under `if TYPE_CHECKING:` never run and are left out: a
helper module may name the type of the object it is handed.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentrl", "envs", "kernels", "launchers", "bench")
LIBRARY = "agentrl"
NOT_IN_LIBRARY = ("bench", "tests")  # top-level packages agentrl must never import

# Circles in files other work owns (issue 21: the run loop, cluster, planner, trainer, rollout and
# local-sandbox areas), left to their owners. Each is expected to be present (strict xfail of its
# absence): once one is gone its check fails, and its entry must be removed. Only modules of those
# areas may be listed here.
OTHERS_OWN = ("agentrl.orchestrator", "agentrl.cluster.", "agentrl.config.plan", "agentrl.train.",
              "agentrl.rollout.", "agentrl.sandbox.local")
KNOWN_CIRCLES: list[frozenset[str]] = []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(path)] = path
    return found


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `source` (module `module`) imports, relative imports
    resolved; a `from X import y` yields X.y (a submodule when there is one) and X."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return out


def _is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> list[tuple[str, int]]:
    return imported_names(path.read_text(), module_name(path), path.name == "__init__.py")


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or its longest prefix that is a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        edges: dict[str, int] = {}
        for name, line in imports_of(path):
            target = resolve(name, modules)
            if target is not None and target != mod:
                edges.setdefault(target, line)
        graph[mod] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per circle, i.e. per strongly connected component of more
    than one module."""
    return [_cycle_in(comp, graph) for comp in components(graph)]


def components(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    for root, root_edges in graph.items():
        if root in index:
            continue
        work = [(root, iter(root_edges))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.add(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        found.append(comp)
    return found


def _cycle_in(comp: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the component's smallest module (breadth-first back to it)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child in comp and child not in parent and child != start:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


def test_the_reader_sees_every_kind_of_import_and_finds_circles():
    src = ("import agentrl.config.schema\nfrom agentrl.buffer import replay\nfrom . import base\n"
           "def f():\n    from ..config.plan import resolve_plan\n")
    names = {n for n, _ in imported_names(src, "agentrl.envs.probe")}
    assert {"agentrl.config.schema", "agentrl.buffer.replay", "agentrl.envs.base",
            "agentrl.config.plan.resolve_plan"} <= names
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agentrl.orchestrator import X\n"
    assert "agentrl.orchestrator" not in {n for n, _ in imported_names(typed, "agentrl.envs.probe")}
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert circles(graph) == [["a", "b", "c", "a"]]
    assert describe(["a", "b", "c", "a"], graph) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circles():
    graph = import_graph()
    new = [comp for comp in components(graph) if frozenset(comp) not in KNOWN_CIRCLES]
    lines = [f"{describe(_cycle_in(comp, graph), graph)}  [all of: {', '.join(sorted(comp))}]" for comp in new]
    assert not new, "import circles:\n" + "\n".join(lines)


def test_known_circles_are_only_in_files_other_work_owns():
    for circle in KNOWN_CIRCLES:
        assert all(m.startswith(OTHERS_OWN) for m in circle), sorted(circle)


@pytest.mark.parametrize("circle", [
    pytest.param(c, id=" <-> ".join(sorted(c)),
                 marks=pytest.mark.xfail(strict=True, reason="a known circle in files other work owns: "
                                         + ", ".join(sorted(c))))
    for c in KNOWN_CIRCLES])
def test_known_circle_is_gone(circle):
    assert circle not in {frozenset(comp) for comp in components(import_graph())}


def test_the_library_imports_no_benchmark_and_no_test():
    modules = project_modules()
    bad = []
    for mod, path in modules.items():
        if mod.split(".")[0] != LIBRARY:
            continue
        for name, line in imports_of(path):
            if name.split(".")[0] in NOT_IN_LIBRARY:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "the library must not import bench/ or tests/:\n" + "\n".join(bad)


def test_no_benchmark_or_test_double_inside_the_library():
    lib = ROOT / LIBRARY
    assert not (lib / "bench").exists(), "benchmarks live in bench/ at the repository root, not agentrl/bench"
    doubles = [p.relative_to(ROOT) for p in lib.rglob("*.py")
               if any(word in p.stem for word in ("standin", "stand_in", "fake", "mock", "dummy"))]
    assert not doubles, f"test doubles live in tests/doubles/, not in the library: {doubles}"
    benches = [p.relative_to(ROOT) for p in lib.rglob("*.py") if p.stem.startswith("bench")]
    assert not benches, f"benchmarks live in bench/, not in the library: {benches}"
