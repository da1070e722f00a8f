"""Helpers for tests and benchmarks of the handshake service (shipped, so no test copies them).

* ``build_registered_engine``: an engine's ``EngineInfo`` and one ``LocalRank`` per (pp, tp) rank, each
  with its own agent and a KV cache already registered with it (layers of its PP stage, heads of its TP
  rank): what a side-channel server needs. ``kvwire.testing.engines.build_engine`` builds the same
  topology unregistered, for a connector (which registers the caches itself).
* ``SilentListener``: a TCP listener that accepts connections and never answers (a hung peer).
* ``manager_pair``: a P side-channel server and a D ``HandshakeManager`` over one inproc fabric.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.cache import KVCache
from kvwire.kv.mapping import layer_window
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import TransferMode
from kvwire.transport.base import make_agent_name, new_incarnation
from kvwire.transport.inproc import InprocFabric
from kvwire.transport.registry import AgentFactory


def build_registered_engine(
    engine_id: str,
    spec: KVSpec,
    num_blocks: int,
    make_agent: AgentFactory,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    model_id: str = "test-model",
    transfer_mode: TransferMode = TransferMode.PUSH,
    incarnation: str | None = None,
) -> tuple[EngineInfo, list[LocalRank]]:
    """An engine with a registered cache per rank; ``make_agent(name)`` creates each rank's agent."""
    info = EngineInfo(
        engine_id=engine_id,
        incarnation=incarnation or new_incarnation(),
        model_id=model_id,
        spec=spec,
        tp_size=tp_size,
        pp_size=pp_size,
        transfer_mode=transfer_mode,
    )
    ranks: list[LocalRank] = []
    for pp in range(pp_size):
        window = layer_window(spec.num_layers, pp_size, pp)
        for tp in range(tp_size):
            agent = make_agent(make_agent_name(engine_id, info.incarnation, pp, tp))
            cache = KVCache(
                spec,
                num_blocks,
                tp_size=tp_size,
                tp_rank=tp,
                first_layer=window.start,
                num_layers=len(window),
            )
            agent.register(cache.slab)
            ranks.append(LocalRank(pp_rank=pp, tp_rank=tp, agent=agent, cache=cache))
    return info, ranks


class SilentListener:
    """Accepts TCP connections and never replies (nor closes them until ``close``)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0
        self.accepted = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_connect, self._host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _on_connect(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.append(writer)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> SilentListener:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass
class ManagerPair:
    """A P side-channel server and a D handshake manager over one inproc fabric (``manager_pair``)."""

    fabric: InprocFabric
    p_info: EngineInfo
    p_ranks: list[LocalRank]
    server: SideChannelServer
    d_info: EngineInfo
    d_rank: LocalRank
    mgr: HandshakeManager

    @property
    def port(self) -> int:
        return self.server.port


@asynccontextmanager
async def manager_pair(
    spec: KVSpec,
    *,
    server_secret: bytes | None = None,
    client_secret: bytes | None = None,
    p_model: str = "test-model",
    p_tp: int = 1,
    p_pp: int = 1,
    port: int = 0,
    **mgr_kwargs: float,
) -> AsyncIterator[ManagerPair]:
    fabric = InprocFabric()
    p_info, p_ranks = build_registered_engine(
        "P", spec, 32, fabric.create_agent, tp_size=p_tp, pp_size=p_pp, model_id=p_model
    )
    d_info, d_ranks = build_registered_engine("D", spec, 16, fabric.create_agent)
    server = SideChannelServer(p_info, p_ranks, port=port, secret=server_secret)
    await server.start()
    mgr = HandshakeManager(d_info, d_ranks[0], secret=client_secret, **mgr_kwargs)  # type: ignore[arg-type]
    try:
        yield ManagerPair(fabric, p_info, p_ranks, server, d_info, d_ranks[0], mgr)
    finally:
        await mgr.close()
        await server.close()
