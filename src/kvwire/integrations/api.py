"""The engine-integration API: what an engine's adapter needs from kvwire, whatever the engine.

An engine embeds kvwire's connector (``kvwire.connector.Producer`` on a prefill engine, ``Consumer`` on a
decode engine) behind its own scheduler and worker hooks. Every adapter does the same four things, here
once: create each rank's agent through the transport registry and pair it with the rank's KV
(``open_ranks``), start the connector of a role (``start_connector``), turn a decode request's
``kv_transfer_params`` into the ``RemoteEngine`` its P is (``remote_engine``), and close it all
(``close_all``). vLLM's adapter (``integrations/vllm/``) and the reference engine
(``kvwire.engine.connector_hooks``) use it; a second engine (SGLang) would too
(``docs/architecture.md``, "add an engine").

What stays the adapter's own: reading the engine's config, wrapping its KV tensors as kvwire KV
(``kvwire.kv.ExternalKV``, zero copy), and mapping its scheduler's steps to ``request_finished`` /
``request_allocated`` / ``abort`` / ``decline`` (a decode request it will not load: P frees the prompt's
blocks at once) and the connector's events back to the engine.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvwire.connector import ConnectorConfig, Consumer, Producer, RemoteEngine
from kvwire.errors import InvalidRequest, TransportError
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.regions import CacheMemory
from kvwire.kv_params import KvTransferParams
from kvwire.protocol.messages import MAX_PORT
from kvwire.transport.base import Agent, make_agent_name
from kvwire.transport.registry import create_agent, lookup
from kvwire.transport.ucx_env import limit_net_devices

log = logging.getLogger(__name__)

__all__ = [
    "Connector",
    "ConnectorT",
    "Endpoint",
    "EngineInfo",
    "LocalRank",
    "RemoteEngine",
    "close_all",
    "open_ranks",
    "remote_engine",
    "start_connector",
]

Connector = Producer | Consumer
ConnectorT = TypeVar("ConnectorT", bound=Producer | Consumer)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a connector's side channel listens, what peers are told to dial, and its secret."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None  # KVWIRE_SIDE_CHANNEL_HOST: what peers dial, when host is 0.0.0.0
    secret: bytes | None = None
    accept_secret: bytes | None = None  # KVWIRE_SECRET_ACCEPT: a second secret taken, never signed with


def open_ranks(
    backend: str,
    engine_id: str,
    incarnation: str,
    caches: Iterable[tuple[tuple[int, int], CacheMemory]],
    connect_timeout_s: float | None = None,
    advertise_host: str | None = None,
) -> tuple[list[Agent], list[LocalRank]]:
    """One agent per ``((pp_rank, tp_rank), cache)`` of this process, of the transport named ``backend``
    (``kvwire.transport.registry``), paired with its cache. On a failure the agents made so far are closed
    and the error raised. ``advertise_host``: the address peers dial for the side channel; NIXL's UCX is kept
    to that address's interface (``limit_net_devices``: a multi-homed host otherwise advertises interfaces a
    peer cannot reach, and UCX may carry notifications over one of them)."""
    if advertise_host is not None and lookup(backend).ucx:
        device = limit_net_devices(advertise_host)
        if device is not None:  # said once: every KV byte of this process now goes over that interface
            log.info(
                "UCX_NET_DEVICES=%s (the interface of %s; set it yourself to choose)", device, advertise_host
            )
    agents: list[Agent] = []
    ranks: list[LocalRank] = []
    try:
        for (pp, tp), cache in caches:
            name = make_agent_name(engine_id, incarnation, pp, tp)
            agents.append(create_agent(backend, name, connect_timeout_s=connect_timeout_s))
            ranks.append(LocalRank(pp_rank=pp, tp_rank=tp, agent=agents[-1], cache=cache))
    except BaseException:
        close_all((), agents)
        raise
    return agents, ranks


def start_connector(
    cls: type[ConnectorT],
    info: EngineInfo,
    ranks: Sequence[LocalRank],
    config: ConnectorConfig,
    at: Endpoint,
    on_event: Callable[[], None] | None = None,
) -> ConnectorT:
    """Start a ``Producer`` (prefill) or ``Consumer`` (decode), as ``cls`` says, serving ``ranks``; its
    side channel's port is ``.port`` once this returns. ``on_event`` (called on kvwire's loop thread at
    every event: wake the engine) is set before it starts."""
    connector = cls(
        info,
        list(ranks),
        config,
        host=at.host,
        port=at.port,
        secret=at.secret,
        advertise_host=at.advertise_host,
        accept_secret=at.accept_secret,
    )
    if on_event is not None:
        connector.on_event(on_event)
    connector.start()
    return connector


def remote_engine(params: KvTransferParams | None, *, rank_ports: bool = False) -> RemoteEngine:
    """The P engine a decode request's ``kv_transfer_params`` designate; ``InvalidRequest`` when they
    name none. ``rank_ports``: P's ranks each listen on their own, consecutive, port (one process per
    rank, as vLLM runs) rather than one listener serving every rank (kvwire's engines)."""
    if params is None:
        raise InvalidRequest("a remote prefill needs kv_transfer_params", "kv_transfer_params")
    engine_id, host, port = params.remote_address()
    last = port + params.tp_size * params.pp_size - 1
    if rank_ports and last > MAX_PORT:
        # Each rank listens on port + rank: a P at 65535 with two ranks names port 65536 (the handshake
        # raised OverflowError, uncounted, once per request: found by a review).
        raise InvalidRequest(
            f"kv_transfer_params: remote_port {port} with {params.tp_size * params.pp_size} ranks "
            f"(one port each, consecutive) runs past port {MAX_PORT}",
            "kv_transfer_params",
        )
    return RemoteEngine(
        engine_id=engine_id,
        host=host,
        port=port,
        tp_size=params.tp_size,
        pp_size=params.pp_size,
        block_ids=params.remote_block_ids or (),
        rank_ports=rank_ports,
        incarnation=params.remote_incarnation,
        hosts=params.rank_hosts(),
    )


def close_all(connectors: Iterable[Connector | None], agents: Iterable[Agent]) -> None:
    """Close the connectors, then the agents (a transport error on close is not the caller's to handle)."""
    for conn in connectors:
        if conn is not None:
            conn.close()
    for agent in agents:
        with contextlib.suppress(TransportError):
            agent.close()
