"""Runs the shipped transport conformance suite against every registered transport
(``kvwire.transport.registry``; ``pytest -k conformance``): a transport added there is checked here.

An out-of-tree backend calls ``run_check(name, lambda: MyFabric().create_agent)`` in its own tests.
"""

from __future__ import annotations

import pytest

from kvwire.testing.conformance import BUILTIN_BACKENDS, CHECKS, check_backend, run_check
from kvwire.transport.inproc import InprocFabric, InprocFaults
from kvwire.transport.registry import AgentFactory

# NIXL's checks carry the ``nixl`` marker (they need NIXL installed); every other transport runs as is.
BACKENDS = [
    pytest.param(n, marks=pytest.mark.nixl) if n == "nixl" else pytest.param(n) for n in BUILTIN_BACKENDS
]


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance(backend: str, check: str) -> None:
    run_check(check, BUILTIN_BACKENDS[backend])


def test_conformance_whole_suite_in_one_call() -> None:
    check_backend(BUILTIN_BACKENDS["inproc"])


def _failing_backend() -> AgentFactory:
    """An inproc fabric whose transfers all end FAILED: not a conforming transport (and it fails at once,
    where a backend losing notifications would cost the checks' whole wait)."""
    fabric = InprocFabric()
    return lambda name: fabric.create_agent(name, InprocFaults(fail_transfers=1_000_000))


def test_conformance_catches_a_broken_backend() -> None:
    with pytest.raises(AssertionError):
        run_check("full_peer_write_read", _failing_backend)
    with pytest.raises(AssertionError):
        check_backend(_failing_backend)
    # A check that moves no bytes still passes: a failure names what is broken.
    run_check("metadata_round_trip", _failing_backend)


def test_conformance_refuses_unknown_check_names() -> None:
    with pytest.raises(ValueError, match="no such conformance checks"):
        check_backend(BUILTIN_BACKENDS["inproc"], skip=("no_such_check",))
