"""The layout of runtime/: no import cycles, and process plumbing defined once.

Imports are read with ``ast``, so imports inside functions and under ``TYPE_CHECKING`` count too:
a cycle hidden behind a lazy import is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "runtime").rglob("*.py"))

KNOWN_CYCLES: list[list[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SOURCES}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package[: len(package) - node.level + 1]
                    base = ".".join([*prefix, *([node.module] if node.module else [])])
                # ``from a import b`` imports the module a.b when there is one, else a.
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("runtime") else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_runtime():
    graph = _import_graph()
    assert "runtime.controller.server" not in graph["runtime.controller.commands"]
    assert _cycles(graph) == KNOWN_CYCLES


def _sources_matching(pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return sorted(str(p.relative_to(ROOT)) for p in SOURCES if regex.search(p.read_text()))


def test_process_plumbing_is_defined_once():
    # CurveZMQ client set-up: transport.connect (curve_server sets the server side there too).
    assert _sources_matching(r"\.curve_serverkey\b") == ["runtime/transport.py"]
    # Logging set-up: runtime.logs.setup_logging.
    assert _sources_matching(r"basicConfig\(|logging\.FileHandler\(") == ["runtime/logs.py"]
    # Starting a controller: launcher.spawn_controller.
    assert _sources_matching(r"\"-m\",\s*\"runtime\.controller\"") == ["runtime/launcher.py"]


def test_no_top_level_name_is_defined_twice_for_different_things():
    """The names issue 10 found twice (and any new pair of public classes or functions)."""
    defined: Counter[str] = Counter()
    for path in [*SOURCES, *sorted((ROOT / "asp_tui").rglob("*.py"))]:
        for node in ast.parse(path.read_text()).body:
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if is_def and not node.name.startswith("_"):
                defined[node.name] += 1
    for name in ("start_controller", "wait_for_endpoints", "ControllerLink"):
        assert defined[name] == 0, name
    twice = {name for name, count in defined.items() if count > 1}
    assert twice <= ALLOWED_TWICE, sorted(twice - ALLOWED_TWICE)


ALLOWED_TWICE = {
    "main",  # every ``python -m`` entry point
    "serve",  # the process body of the rollout worker and of the sim backend
}


def test_no_class_in_runtime_is_longer_than_500_lines():
    """One concern per class: the controller was one class of 1,460 lines (issue 10)."""
    long = [
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 500
    ]
    assert long == []
