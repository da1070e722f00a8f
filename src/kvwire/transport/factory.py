"""Create an agent of a chosen backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvwire.config import Backend as Backend
from kvwire.errors import ConfigError
from kvwire.transport.base import Agent

if TYPE_CHECKING:
    from kvwire.transport.inproc import InprocFabric, InprocFaults

# Makes an agent named ``name`` (see ``make_agent_name``): how a backend is handed to code that must not
# pick one itself (test harnesses, benches, the conformance suite), e.g. ``InprocFabric().create_agent``.
AgentFactory = Callable[[str], Agent]


_default_fabric: InprocFabric | None = None


def default_fabric() -> InprocFabric:
    """The process-wide fabric used when ``create_agent("inproc", ...)`` is given none."""
    global _default_fabric
    if _default_fabric is None:
        from kvwire.transport.inproc import InprocFabric

        _default_fabric = InprocFabric()
    return _default_fabric


def create_agent(
    backend: str | Backend,
    name: str,
    *,
    fabric: InprocFabric | None = None,
    faults: InprocFaults | None = None,
    connect_timeout_s: float | None = None,
) -> Agent:
    """An agent named ``name`` (see ``make_agent_name``). ``fabric``/``faults`` apply to ``inproc`` only;
    ``connect_timeout_s`` (the handshake deadline) to ``nixl`` only: UCX's connect timeouts follow it."""
    try:
        chosen = Backend(backend)
    except ValueError as exc:
        raise ConfigError(f"unknown transport backend {backend!r}; known: nixl, inproc") from exc
    if chosen is Backend.NIXL:
        # Imported here so that the inproc backend works where NIXL is not installed.
        from kvwire.transport.nixl import NixlAgent

        if connect_timeout_s is None:
            return NixlAgent(name)
        return NixlAgent(name, connect_timeout_s=connect_timeout_s)
    return (fabric or default_fabric()).create_agent(name, faults)
