"""Importing a protocol core loads no I/O: no asyncio, threads, sockets or randomness, no transport and no
handshake service. Each core is imported in a fresh interpreter, so what the test process already loaded
does not hide an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvwire

CORES = (
    "kvwire.core",
    "kvwire.core.consumer",
    "kvwire.core.consumer_pull",
    "kvwire.core.producer",
    "kvwire.core.producer_push",
    "kvwire.core.io",
    "kvwire.core.types",
    "kvwire.core.handshake",
    "kvwire.core.handshake_io",
    "kvwire.core.breaker",
    "kvwire.core.reports",
)
# Modules that mean I/O, threads or randomness, and kvwire's own I/O layers. ``logging`` is here because
# it loads ``threading``: the cores import it only when they log a line (``kvwire.core.base.core_log``).
# Not ``uuid``: msgspec's C core imports it when msgspec loads, and the cores' messages are msgspec Structs.
FORBIDDEN = (
    "asyncio",
    "threading",
    "socket",
    "selectors",
    "ssl",
    "random",
    "secrets",
    "logging",
    "concurrent.futures",
    "kvwire.transport",
    "kvwire.handshake",
    "kvwire.connector",
)


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    src = str(Path(kvwire.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", CORES)
def test_importing_a_core_loads_no_io(module: str) -> None:
    loaded = _loaded_after(module)
    assert module in loaded
    assert sorted(m for m in FORBIDDEN if m in loaded) == []


def test_the_check_sees_io_where_it_is() -> None:
    """The same probe on a module that does I/O finds it (the test above could not pass by not looking)."""
    loaded = _loaded_after("kvwire.handshake.types")
    assert {"asyncio", "threading", "socket", "kvwire.handshake"} <= loaded
