"""kvwire's import graph: layers, bottom to top, and no circle.

A module may import a module of its own top-level package, or of a package in a LOWER layer; packages in
the same layer do not import each other (they are independent: the engine does not know the router).
Every import counts, at module level or inside a function (a lazy import is still a dependency); only
imports under ``if TYPE_CHECKING:`` are left out, since they never run. Besides, no two modules may
import each other through any chain (every strongly connected component is one module).

    cli, serve                           the command line; ``kvwire serve``, the one module knowing every role
    testing                              the test kit: fakes, the simulator, process helpers, conformance
    engine, router                       what runs: the reference engine, the router
    integrations                         the engine-integration API and vLLM's adapter on it
    discovery                            records under leases in a source (etcd), registration, watching
    connector                            the threaded driver of the cores
    handshake                            side channel: client, server, manager
    transport                            agents: NIXL, in-process
    options                              command-line options machinery (no role's table)
    config, logsetup, apikey, kv_params, startup, metrics   process plumbing, one concern each
    core                                 the sans-IO protocol cores
    kv                                   KV layouts, caches, descriptors
    protocol                             wire messages, codecs, states, limits, plain values
    errors                               the error hierarchy

``docs/architecture.md`` explains the layers and how to add a transport, an engine or a discovery source.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import kvwire

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("protocol",),
    ("kv",),
    ("core",),
    ("config", "logsetup", "apikey", "kv_params", "startup", "metrics"),
    ("options",),
    ("transport",),
    ("handshake",),
    ("connector",),
    ("discovery",),
    ("integrations",),
    ("engine", "router"),
    ("testing",),
    ("cli", "serve"),
)
ROOT = Path(kvwire.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["kvwire", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for stmt in node.orelse for n in _import_nodes_of(stmt))
            continue
        yield from _import_nodes_of(node)


def _import_nodes_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _import_nodes(node)


def _known(name: str) -> str | None:
    """The kvwire module ``name`` is, or is in (``kvwire.x.y.Class`` -> ``kvwire.x.y``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name`` imports mod.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        out |= {m for m in map(_known, names) if m is not None and m != module}
    return out


GRAPH = {module: imports_of(module) for module in MODULES}


def _package(module: str) -> str:
    return module.split(".")[1] if module != "kvwire" else ""


def _layer_of() -> dict[str, int]:
    return {package: i for i, layer in enumerate(LAYERS) for package in layer}


def test_every_package_has_a_layer() -> None:
    layer = _layer_of()
    assert sorted({_package(m) for m in MODULES} - set(layer) - {""}) == []
    assert len(layer) == sum(len(group) for group in LAYERS)  # no package in two layers
    assert GRAPH["kvwire"] == set()  # the root package imports nothing: every module imports it


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    layer = _layer_of()
    bad = []
    for module, targets in graph.items():
        for target in targets:
            own, their = _package(module), _package(target)
            if own != their and layer[their] >= layer[own]:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_layer_above_its_own_or_beside_it() -> None:
    assert upward_imports(GRAPH) == []


def test_no_circle_of_modules() -> None:
    assert cycles(GRAPH) == []


def test_the_checks_see_what_they_must() -> None:
    """The checks find an arrow up, a sideways arrow, a circle and a lazy import where there is one (so
    the tests above cannot pass by looking at nothing)."""
    assert "kvwire.connector._base" in GRAPH["kvwire.connector.consumer"]
    assert "kvwire.core.consumer" in GRAPH["kvwire.connector.consumer"]
    assert "kvwire.router.app" in GRAPH["kvwire.router.cli"]  # imported inside run_router
    fake = {
        "kvwire.core.base": {"kvwire.transport.base"},  # up
        "kvwire.engine.x": {"kvwire.router.y"},  # sideways
        "kvwire.router.y": set(),
        "kvwire.transport.base": set(),
        "kvwire.testing.a": {"kvwire.testing.b"},
        "kvwire.testing.b": {"kvwire.testing.c"},
        "kvwire.testing.c": {"kvwire.testing.a"},
    }
    assert upward_imports(fake) == [
        "kvwire.core.base -> kvwire.transport.base",
        "kvwire.engine.x -> kvwire.router.y",
    ]
    assert cycles(fake) == [["kvwire.testing.a", "kvwire.testing.b", "kvwire.testing.c"]]


def test_docs_architecture_lists_the_same_layers() -> None:
    """docs/architecture.md's layer table says what this test checks (so the doc stays true)."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
    rows = [line.split("|") for line in doc.read_text().splitlines() if re.match(r"\| \d+ \|", line)]
    documented = {int(cells[1]): tuple(re.findall(r"`([a-z_]+)`", cells[2])) for cells in rows}
    assert documented == dict(enumerate(LAYERS))
