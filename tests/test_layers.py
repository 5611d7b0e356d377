"""The layers of DESIGN.md, enforced: a module imports only from its own layer or below.

Every ``import`` in the package counts, wherever it is written: at the top, inside a
function (a lazy import is still a dependency) or under ``TYPE_CHECKING`` (a low module
typed on a high one knows its users). Read from the source, so nothing is imported here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tensorx

PACKAGE = Path(tensorx.__file__).parent

# Bottom up. A module's layer is that of the longest prefix naming it; one that matches
# none is unplaced (place it here when you add it).
LAYERS: dict[str, float] = {
    # pure foundations: nothing else of tensorx but each other
    "tensorx.errors": 0, "tensorx._text": 0, "tensorx._deadline": 0,
    "tensorx._counters": 0, "tensorx._ratelog": 0, "tensorx._schema": 0, "tensorx._loud": 0,
    # codecs and OS helpers
    "tensorx._wire": 1, "tensorx._auth": 1, "tensorx._shm": 1, "tensorx._cuda": 1,
    "tensorx._queues": 1, "tensorx._netns": 1, "tensorx._eventloop": 1, "tensorx._cache": 1,
    "tensorx._owned": 1, "tensorx._backoff": 1, "tensorx._redial": 1,
    "tensorx._backing": 1.5, "tensorx.memregion": 2, "tensorx._exports": 2.05,
    "tensorx._opcheck": 2.05, "tensorx._rows": 2.06,
    # planning, pure, in this order: data, codec, torch views, the plan users get, planners
    "tensorx._analyzer.layout": 2.1, "tensorx._analyzer.wire": 2.2,
    "tensorx._analyzer.balance": 2.2, "tensorx._analyzer.sample": 2.2,
    "tensorx._analyzer.binding": 2.4,
    "tensorx._analyzer.plan": 2.5, "tensorx._analyzer.planner": 2.6,
    "tensorx._analyzer.boundary": 2.6, "tensorx._analyzer": 2.7,
    "tensorx.graph_analyzer": 2.8,
    "tensorx.transport": 3,
    "tensorx.endpoint": 4, "tensorx._peerexports": 4, "tensorx._peers": 4, "tensorx.node": 4,
    # exporters read nodes, shards and workers through protocols of their own
    "tensorx._prometheus": 4.5, "tensorx.metrics": 4.5,
    # the parameter server's parts: what both sides agree on and share, the sparse rows,
    # the update's math, one shard's memory, then each side on its own
    "tensorx._ps": 5, "tensorx._ps.wire": 5.1, "tensorx._ps.common": 5.1,
    "tensorx._ps.rows": 5.2, "tensorx._ps.update": 5.3, "tensorx._ps.state": 5.4,
    "tensorx._ps.service": 5.5, "tensorx._ps.worker": 5.5,
    "tensorx.ps": 5.6, "tensorx.worker": 5.6, "tensorx.remote_optimizer": 5.6,
    # pipeline stages: beside the parameter server (the launcher's store is shared)
    "tensorx.pipelining": 5.6,
    "tensorx": 6,  # the public facade
    "tensorx.testing": 7, "tensorx._commands": 7, "tensorx.cli": 7, "tensorx.__main__": 7,
}
# Layers that must not know each other although one sits above the other.
APART = [
    ("tensorx.transport", "tensorx._analyzer"), ("tensorx.transport", "tensorx.graph_analyzer"),
    ("tensorx._ps", "tensorx.transport"), ("tensorx.ps", "tensorx.transport"),
    ("tensorx.worker", "tensorx.transport"), ("tensorx.pipelining", "tensorx.transport"),
    # a shard's side and a worker's share only what lies below both
    ("tensorx._ps.service", "tensorx._ps.worker"), ("tensorx.ps", "tensorx._ps.worker"),
    ("tensorx.worker", "tensorx._ps.service"),
]
# Cores that do no I/O (STYLE.md 6): tested without sockets or an event loop.
PURE = ["tensorx.errors", "tensorx._text", "tensorx._counters", "tensorx._schema",
        "tensorx._wire", "tensorx.memregion", "tensorx._analyzer", "tensorx.graph_analyzer",
        "tensorx._opcheck", "tensorx._rows", "tensorx._backoff",
        "tensorx._ps.wire", "tensorx._ps.update", "tensorx._ps.state", "tensorx._ps.rows.tables",
        "tensorx._ps.rows.header", "tensorx._ps.rows.staging", "tensorx._ps.rows.changed",
        "tensorx._ps.rows.pull", "tensorx._ps.common.abtimer",
        "tensorx._ps.common.stats", "tensorx._ps.service.schedule", "tensorx._ps.service.round",
        "tensorx._ps.service.admission", "tensorx._ps.service.optim_load"]
IO = {"asyncio", "socket", "selectors"}
# Import cycles not yet taken apart (each is also a layering smell); the test fails when a
# new one appears, and when one of these is gone (then strike it off).
KNOWN_CYCLES: list[set[str]] = []


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, lazy or typing-only too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub if _is_module(sub) else node.module, node.lineno))
    return out


def _layer(name: str) -> float | None:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len,
               default=None)
    return None if best is None else LAYERS[best]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {(t, line) for t, line in _imports(p) if _under(t, "tensorx") and t != m}
         for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if _layer(m) is None] == []


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = [f"{m} ({_layer(m)}) imports {t} ({_layer(t)}) at line {line}"
              for m, targets in GRAPH.items() for t, line in sorted(targets)
              if (_layer(t) or 0) > (_layer(m) or 0)]
    assert upward == []


def test_layers_kept_apart_do_not_import_each_other() -> None:
    crossing = [f"{m} imports {t} at line {line}"
                for m, targets in GRAPH.items() for t, line in sorted(targets)
                for low, high in APART
                if (_under(m, low) and _under(t, high)) or (_under(m, high) and _under(t, low))]
    assert crossing == []


def test_pure_cores_do_no_io() -> None:
    found = [f"{m} imports {t} at line {line}"
             for m, p in MODULES.items() if any(_under(m, core) for core in PURE)
             for t, line in _imports(p) if t.split(".")[0] in IO]
    assert found == []


def _cycles() -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {m: {t for t, _ in targets if t in MODULES} for m, targets in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_new_import_cycles_and_the_known_ones_still_exist() -> None:
    found = _cycles()
    assert [c for c in found if c not in KNOWN_CYCLES] == []
    assert [c for c in KNOWN_CYCLES if c not in found] == []


@pytest.mark.parametrize(("module", "absent"), [
    ("tensorx", ["torch", "tensorx.ps", "tensorx.worker", "tensorx.graph_analyzer",
                 "tensorx.metrics", "prometheus_client"]),
    ("tensorx.metrics", ["torch", "tensorx.ps", "tensorx.worker", "prometheus_client"]),
])
def test_importing_does_not_load_what_it_does_not_need(module: str, absent: list[str]) -> None:
    code = (f"import sys, {module}; "
            f"print([m for m in {absent!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
