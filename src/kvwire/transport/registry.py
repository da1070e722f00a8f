"""Transports by name: the one place that knows which transports exist.

A transport is a module that defines ``TRANSPORT``, a ``Transport`` (how to create its agents, and how
the conformance suite gets a fresh set of agents that reach each other). ``BUILTIN`` maps each name to
that module; it is read on the first lookup of a name, so importing this module imports no transport
(NIXL loads only where a NIXL agent is made). Adding a transport is its module plus one line here
(``docs/architecture.md``'s recipe). A transport outside kvwire calls ``register`` once, at start-up.

``--backend`` (``kvwire.config.Backend``, a plain name) is checked against ``names()``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwire.errors import ConfigError
from kvwire.transport.base import Agent, FullAgent

if TYPE_CHECKING:
    from kvwire.transport.inproc import InprocFabric, InprocFaults

# name -> the module whose ``TRANSPORT`` it is. One line per transport.
BUILTIN: dict[str, str] = {
    "nixl": "kvwire.transport.nixl",
    "inproc": "kvwire.transport.inproc",
}

# Makes an agent named ``name`` (see ``make_agent_name``): how a backend is handed to code that must not
# pick one itself (test harnesses, benches, the conformance suite), e.g. ``InprocFabric().create_agent``.
AgentFactory = Callable[[str], Agent]
# The same for agents with ``FullAgent``'s extras (what the conformance suite and benches use).
FullAgentFactory = Callable[[str], FullAgent]


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """What a caller may say about an agent beyond its name; a transport uses what applies to it.

    ``connect_timeout_s``: the handshake's deadline (NIXL: UCX's connect timeouts follow it).
    ``fabric`` / ``faults``: the in-process fabric to join and the faults to inject (``inproc`` only).
    """

    connect_timeout_s: float | None = None
    fabric: InprocFabric | None = None
    faults: InprocFaults | None = None


@dataclass(frozen=True, slots=True)
class Transport:
    """One transport: its name, how to create an agent, and a fresh ``AgentFactory`` for the conformance
    suite (agents of one factory reach each other; ``kvwire.testing.conformance``)."""

    name: str
    create: Callable[[str, AgentOptions], Agent]
    conformance_factory: Callable[[], FullAgentFactory]
    # Carries its bytes over UCX: an engine that advertises one address keeps UCX to that address's
    # interface (``kvwire.integrations.api.open_ranks``: ``limit_net_devices``).
    ucx: bool = False


_lock = threading.Lock()
_loaded: dict[str, Transport] = {}
_extra: dict[str, Transport] = {}


def names() -> tuple[str, ...]:
    """Every transport's name, built-in first (``--backend``'s choices)."""
    return (*BUILTIN, *(n for n in _extra if n not in BUILTIN))


def register(transport: Transport) -> None:
    """Make a transport defined outside kvwire known by its name (call once, at start-up)."""
    if transport.name in BUILTIN:
        raise ConfigError(f"transport {transport.name!r} is built in")
    with _lock:
        _extra[transport.name] = transport


def lookup(name: str) -> Transport:
    """The transport named ``name``; ``ConfigError`` naming the known ones otherwise."""
    with _lock:
        found = _loaded.get(name) or _extra.get(name)
    if found is not None:
        return found
    module = BUILTIN.get(name)
    if module is None:
        raise ConfigError(f"unknown transport backend {name!r}; known: {', '.join(names())}")
    transport = importlib.import_module(module).TRANSPORT
    if not isinstance(transport, Transport) or transport.name != name:
        raise ConfigError(f"{module}.TRANSPORT is not the Transport named {name!r}")
    with _lock:
        _loaded[name] = transport
    return transport


def create_agent(
    backend: str,
    name: str,
    *,
    fabric: InprocFabric | None = None,
    faults: InprocFaults | None = None,
    connect_timeout_s: float | None = None,
) -> Agent:
    """An agent of the transport named ``backend``, named ``name`` (see ``make_agent_name``): how the
    engines' connector hooks and vLLM's worker create agents."""
    options = AgentOptions(connect_timeout_s=connect_timeout_s, fabric=fabric, faults=faults)
    return lookup(backend).create(name, options)
