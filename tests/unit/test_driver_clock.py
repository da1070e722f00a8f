"""The drivers read time through one injected clock, and dispatch every action exhaustively.

One clock: the connector is built with ``clock`` (``time.monotonic`` by default) and hands it to its
handshake managers (and their breakers), its reporter, its side-channel server and its timeline marks,
so a test or the simulator that injects a clock controls every timer. An ast scan of the driver packages
finds any direct read of the system clock; the only ones allowed are listed with why.

Exhaustive dispatch: every driver dispatches the action union of the core it drives with a ``match``
that ends in ``case _: assert_never(action)``, so mypy (strict) fails when a new action is not handled.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvwire

SRC = Path(kvwire.__file__).parent
DRIVERS = ("connector", "handshake", "testing/sim")
CLOCK_READS = {"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"}
# (module, function called): reads that are not timers' time.
ALLOWED = {
    # The peer's clock offset is measured against the real wall clock, and the RTT of that one exchange
    # in real time: what is measured is the machines' clocks themselves, not a timer.
    ("handshake/client.py", "time"),
    ("handshake/client.py", "perf_counter"),
    ("handshake/server.py", "time"),  # the wall clock the metadata reply carries for that measurement
    # One connection's I/O deadline is asyncio's own clock (``asyncio.timeout`` reads the same): read
    # again at expiry, it tells how late the timeout fired (a stalled loop), not when a timer is due.
    ("handshake/client.py", "loop.time"),
    ("testing/sim/run.py", "perf_counter"),  # the simulator's own wall-clock speed figure
}
# Driver functions that execute a core's actions: each must be an exhaustive match.
DISPATCHERS = {
    "connector/_base.py": ("_execute",),
    "connector/reports.py": ("submit",),
    "handshake/manager.py": ("_run",),
    "testing/sim/engines.py": ("_execute",),
    "testing/sim/handshakes.py": ("_run",),
}


def _clock_reads(tree: ast.AST) -> list[tuple[str, int]]:
    """Calls of ``time.X()`` (or ``loop.time()``) for a clock-reading X, with their line."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, owner = node.func.attr, node.func.value
        if attr in CLOCK_READS and isinstance(owner, ast.Name) and owner.id == "time":
            found.append((attr, node.lineno))
        elif attr == "time" and not node.args and isinstance(owner, ast.Call):
            found.append(("loop.time", node.lineno))  # asyncio.get_running_loop().time()
        elif attr == "time" and not node.args and isinstance(owner, ast.Name) and owner.id == "loop":
            found.append(("loop.time", node.lineno))
    return found


def _driver_modules() -> list[Path]:
    return sorted(p for d in DRIVERS for p in (SRC / d).rglob("*.py"))


def test_drivers_read_time_only_through_their_injected_clock() -> None:
    bad = []
    for path in _driver_modules():
        rel = path.relative_to(SRC).as_posix()
        for fn, line in _clock_reads(ast.parse(path.read_text())):
            if (rel, fn) not in ALLOWED:
                bad.append(f"{rel}:{line}: {fn}()")
    assert bad == []


def test_the_scan_finds_clock_reads() -> None:
    code = (
        "import time, asyncio\nt = time.monotonic()\nu = asyncio.get_running_loop().time()\nv = loop.time()\n"
    )
    assert [fn for fn, _ in _clock_reads(ast.parse(code))] == ["monotonic", "loop.time", "loop.time"]
    assert _clock_reads(ast.parse("def f(clock=time.monotonic): return clock()")) == []


def _is_exhaustive(fn: ast.FunctionDef) -> bool:
    """The function holds a ``match`` whose last case is ``case _: assert_never(...)``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Match) and node.cases:
            last = node.cases[-1]
            wild = isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None
            body = last.body[0] if last.body else None
            call = body.value if isinstance(body, ast.Expr) else None
            if wild and isinstance(call, ast.Call) and getattr(call.func, "id", "") == "assert_never":
                return True
    return False


def test_every_driver_dispatch_is_an_exhaustive_match() -> None:
    missing = []
    for rel, names in DISPATCHERS.items():
        tree = ast.parse((SRC / rel).read_text())
        found = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        missing += [f"{rel}:{name}" for name in names if name not in found or not _is_exhaustive(found[name])]
    assert missing == []


def test_the_dispatch_check_tells_a_chain_of_ifs_from_a_match() -> None:
    chain = "def _execute(a):\n    if isinstance(a, int):\n        pass\n"
    match = (
        "def _execute(a):\n    match a:\n        case int():\n            pass\n"
        "        case _:\n            assert_never(a)\n"
    )
    (fn_chain,) = ast.parse(chain).body
    (fn_match,) = ast.parse(match).body
    assert isinstance(fn_chain, ast.FunctionDef) and isinstance(fn_match, ast.FunctionDef)
    assert not _is_exhaustive(fn_chain) and _is_exhaustive(fn_match)
