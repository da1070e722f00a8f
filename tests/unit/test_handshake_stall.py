"""A peer load that never returns (NIXL's add_remote_agent toward an unreachable UCX port, modelled by the
inproc backend's ``stall_loads_s``): the handshake fails with ``HandshakeTimeout`` at its deadline, the
loop keeps running meanwhile, the stuck load is counted and reported (``stalled_s``), and later loads on
that agent are refused at once until it returns. ``CallWorker`` itself is checked in test_agent_offload.py;
the real thing, across network namespaces, in tests/faults/test_blocked_ucx_port.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest

from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.model import Model
from kvwire.engine.server import EngineServer, Identity
from kvwire.errors import AgentBusy, HandshakeTimeout
from kvwire.handshake.manager import HandshakeManager, stalled_reason
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import FailureReason
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import ErrorReply, Metadata
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.base import PeerMode
from kvwire.transport.inproc import InprocAgent, InprocFabric, InprocFaults

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
HOST = "127.0.0.1"
TIMEOUT_S = 0.5
SLACK_S = 0.5


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


async def _max_gap(stop: asyncio.Event, gaps: list[float]) -> None:
    """Record how long the loop went without running this task (it asks to run every 10 ms)."""
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


async def _health(managers: list[HandshakeManager]) -> httpx.Response:
    """GET /health of a reference engine whose health check is ``stalled_reason(managers)``."""
    cfg = preset("tiny")
    engine = Engine(EngineConfig(cfg, role=Role.DECODE, num_blocks=16), model=Model(cfg, seed=0))
    server = EngineServer(engine, Identity(Role.DECODE, "D", "inc0", HOST, 0))
    server.health_checks.append(lambda: stalled_reason(managers))
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        return await client.get("/health")


def test_stuck_load_times_out_reports_and_refuses_while_the_loop_runs() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent)
        stalled = InprocFaults(stall_loads_s=60.0)

        def make_agent(name: str) -> InprocAgent:
            # Only rank 0's loads stall: rank 1 stands for another local agent of the same engine.
            return fabric.create_agent(name, stalled if name.endswith("tp0") else None)

        d_info, d_ranks = build_registered_engine("D", SPEC, 8, make_agent, tp_size=2)
        server = SideChannelServer(p_info, p_ranks, port=0)
        await server.start()
        stuck_mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=TIMEOUT_S, clock_samples=1)
        other_mgr = HandshakeManager(d_info, d_ranks[1], timeout_s=TIMEOUT_S, clock_samples=1)
        stuck_agent = d_ranks[0].agent
        assert isinstance(stuck_agent, InprocAgent)
        stop, gaps = asyncio.Event(), list[float]()
        ticker = asyncio.create_task(_max_gap(stop, gaps))
        try:
            t0 = time.monotonic()
            with pytest.raises(HandshakeTimeout, match="did not return within"):
                await stuck_mgr.ensure(HOST, server.port, 0, 0, PeerMode.NOTIF_ONLY)
            took = time.monotonic() - t0
            assert TIMEOUT_S * 0.8 <= took <= TIMEOUT_S + SLACK_S, took
            assert stuck_mgr.stats.failures[FailureReason.TIMEOUT] == 1
            assert stuck_mgr.stuck_loads == 1 and stuck_mgr.stalled_s() >= took * 0.8
            # Another rank's agent is not held: its handshake completes while the load is stuck.
            assert (await other_mgr.ensure(HOST, server.port, 0, 0, PeerMode.FULL)).engine_id == "P"
            # The held agent refuses a new load at once instead of queueing it behind the stuck one.
            t1 = time.monotonic()
            with pytest.raises(AgentBusy, match="refused"):
                await stuck_mgr.ensure(HOST, server.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert time.monotonic() - t1 < TIMEOUT_S
            assert stuck_mgr.stats.failures[FailureReason.TRANSPORT] == 1
            assert max(gaps) < 0.2, f"the loop stalled for {max(gaps):.3f} s"
            # The engine's /health says so (503: the router stops sending it requests).
            health = await _health([stuck_mgr, other_mgr])
            assert health.status_code == 503 and stuck_agent.name in health.json()["problems"][0]
            # The network heals: the stuck call returns, nothing holds the agent any more.
            stalled.stall_loads_s = 0.0
            stuck_agent.unstall.set()
            for _ in range(100):
                if stuck_mgr.stalled_s() == 0.0:
                    break
                await asyncio.sleep(0.01)
            assert stuck_mgr.stalled_s() == 0.0
            assert stalled_reason([stuck_mgr, other_mgr]) is None
            assert (await _health([stuck_mgr, other_mgr])).status_code == 200
            peer = await stuck_mgr.ensure(HOST, server.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert stuck_agent.peer_mode(peer.agent_name) is PeerMode.NOTIF_ONLY
        finally:
            stop.set()
            await ticker
            stuck_agent.unstall.set()
            await stuck_mgr.close()
            await other_mgr.close()
            await server.close()

    run(body)


def test_the_deadline_covers_fetch_and_load_together() -> None:
    """``timeout_s`` bounds the whole handshake: a slow fetch leaves the load only what is left."""

    async def body() -> None:
        fabric = InprocFabric()
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent)
        faults = InprocFaults(stall_loads_s=60.0)
        d_info, d_ranks = build_registered_engine("D", SPEC, 8, lambda n: fabric.create_agent(n, faults))
        server = SideChannelServer(p_info, p_ranks, port=0)
        await server.start()
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=TIMEOUT_S, clock_samples=1)
        real_send = server._send

        async def slow_send(writer: asyncio.StreamWriter, reply: Metadata | ErrorReply) -> None:
            await asyncio.sleep(TIMEOUT_S * 0.6)  # the reply comes late: the load gets what is left
            await real_send(writer, reply)

        server._send = slow_send  # type: ignore[method-assign]
        try:
            t0 = time.monotonic()
            with pytest.raises(HandshakeTimeout):
                await mgr.ensure(HOST, server.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert time.monotonic() - t0 <= TIMEOUT_S + SLACK_S
        finally:
            d_ranks[0].agent.unstall.set()  # type: ignore[attr-defined]
            await mgr.close()
            await server.close()

    run(body)
