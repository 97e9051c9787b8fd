"""The package's layering, from its source: every import statement (module level, inside functions, under
TYPE_CHECKING), resolved to kvfence modules. No cycles; no forbidden arrow (docs/structure.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvfence"

# package -> packages it must never import (a package is kvfence's first-level name: kv, engine, server, ...)
FORBIDDEN = {
    "ids": {"*"},
    "faults": {"*"},
    "config": {"engine", "kv", "server", "pd", "runtime", "dashboard", "probe", "sim", "cli", "flags"},
    "kv": {"engine", "model", "server", "pd", "runtime", "dashboard", "probe", "sim", "cli", "flags"},
    "model": {"server", "pd", "runtime", "dashboard", "probe", "sim", "cli", "flags"},
    "engine": {"server", "pd", "runtime", "dashboard", "probe", "sim", "cli", "flags"},
    "server": {"pd", "runtime", "probe", "sim", "cli", "flags"},
    "pd": {"server", "runtime", "probe", "cli", "flags"},
    "dashboard": {"runtime", "probe", "sim", "cli", "flags"},
    "probe": {"engine", "model", "kv", "pd", "server", "runtime", "dashboard", "sim", "config", "flags"},
    "sim": {"server", "runtime", "probe", "cli", "flags"},
    "runtime": {"cli"},
    "flags": {"engine", "kv", "model", "server", "pd", "runtime", "dashboard", "probe", "sim", "cli"},
}
ALWAYS_ALLOWED = {"ids", "faults", "trace"}  # leaves every layer may use (torch-free, no kvfence imports)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The kvfence modules `name` imports anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            for alias in node.names:  # `from kvfence import trace` imports a module, `from x import f` a name
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name and m.startswith("kvfence.")}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvfence"


def test_the_walk_sees_function_level_and_type_checking_imports():
    assert "kvfence.runtime.colocated" in GRAPH["kvfence.cli"] or any(
        m.startswith("kvfence.runtime") for m in GRAPH["kvfence.cli"]
    )
    assert "kvfence.engine.llm_engine" in GRAPH["kvfence.runtime.colocated"]  # inside a function
    assert "kvfence.engine.llm_engine" in GRAPH["kvfence.dashboard.snapshot"]  # under TYPE_CHECKING


def test_no_import_cycles():
    """Tarjan's strongly connected components: any component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("source", sorted(MODULES))
def test_no_forbidden_arrow(source):
    banned = FORBIDDEN.get(layer(source), set())
    bad = sorted(
        target
        for target in GRAPH[source]
        if layer(target) not in ALWAYS_ALLOWED and ("*" in banned or layer(target) in banned)
    )
    assert not bad, f"{source} must not import {bad}"


def test_only_the_runtime_imports_both_the_server_and_the_pd_cluster():
    both = [m for m, targets in GRAPH.items() if {layer(t) for t in targets} >= {"server", "pd"}]
    assert all(layer(m) == "runtime" for m in both), both


def test_command_line_modules_are_leaves():
    for leaf in ("kvfence.cli", "kvfence.__main__"):
        importers = sorted(m for m, targets in GRAPH.items() if leaf in targets and m != "kvfence.__main__")
        assert not importers, f"{leaf} is imported by {importers}"
    importers = sorted(
        m for m, t in GRAPH.items() if any(layer(x) == "runtime" for x in t) and layer(m) != "runtime"
    )
    assert importers == ["kvfence.cli"], importers


def test_the_probe_never_imports_the_engine():
    engine_side = {"engine", "kv", "model", "pd", "server", "runtime", "sim"}
    for module, targets in GRAPH.items():
        if layer(module) == "probe":
            assert not {layer(t) for t in targets} & engine_side, (module, targets)
