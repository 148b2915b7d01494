"""The package's import graph, read from the source (every import, inside functions too): no circle anywhere, and
the worker's rooms only import downwards (a room may use the rooms below it and itself, never one above)."""

from __future__ import annotations

import ast
from pathlib import Path

import pp_worker

ROOT = Path(pp_worker.__file__).parent
# the worker's rooms, lowest first; the worker's own modules (cli, dispatch, loop, ...) stand above them all
ROOMS = [("hostio", "hugemem", "cachedir", "device", "shard"), ("gguf",), ("text",), ("cpu",), ("compiled",),
         ("engines",)]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each pp_worker module -> the pp_worker modules it imports (``from a import b``: a.b when that is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def room(module: str) -> int:
    """The rank of a worker module's room (len(ROOMS) for the worker's own modules); -1 outside the worker."""
    parts = module.split(".")
    if parts[:2] != ["pp_worker", "worker"] or len(parts) < 3:
        return -1
    return next((rank for rank, names in enumerate(ROOMS) if parts[2] in names), len(ROOMS))


def test_no_module_imports_itself_back_through_others():
    graph, state, stack = imports(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_worker_s_rooms_import_only_downwards():
    graph = imports()
    up = sorted((m, n) for m, targets in graph.items() for n in targets
                if room(m) >= 0 and room(n) >= 0 and room(n) >= room(m) and room(n) > 0
                and m.split(".")[2] != n.split(".")[2] and room(m) < len(ROOMS))
    assert up == [], f"imports that go up or sideways between rooms: {up}"
    assert any(room(n) == 3 for n in graph["pp_worker.worker.engines.weights"])  # the check sees real edges
