"""Runs the shipped transport conformance suite against both built-in backends (``pytest -k conformance``).

A third backend would be one more entry here, ``run_check(name, lambda: MyFabric().create_agent)``.
"""

from __future__ import annotations

import pytest

from kvwire.testing.conformance import BUILTIN_BACKENDS, CHECKS, check_backend, run_check
from kvwire.transport.factory import AgentFactory
from kvwire.transport.inproc import InprocFabric, InprocFaults

BACKENDS = [pytest.param("inproc"), pytest.param("nixl", marks=pytest.mark.nixl)]


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance(backend: str, check: str) -> None:
    run_check(check, BUILTIN_BACKENDS[backend])


def test_conformance_whole_suite_in_one_call() -> None:
    check_backend(BUILTIN_BACKENDS["inproc"])


def _dropping_backend() -> AgentFactory:
    """An inproc fabric whose agents lose every notification: not a conforming transport."""
    fabric = InprocFabric()
    return lambda name: fabric.create_agent(name, InprocFaults(drop_rate=1.0))


def test_conformance_catches_a_broken_backend() -> None:
    with pytest.raises(AssertionError, match="notifications"):
        run_check("notif_only_peer", _dropping_backend)
    with pytest.raises(AssertionError):
        check_backend(_dropping_backend)
    # The checks that send no notification still pass: a failure names what is broken.
    check_backend(_dropping_backend, skip=("notif_only_peer", "attached_notif_after_data", "post_array"))


def test_conformance_refuses_unknown_check_names() -> None:
    with pytest.raises(ValueError, match="no such conformance checks"):
        check_backend(BUILTIN_BACKENDS["inproc"], skip=("no_such_check",))
