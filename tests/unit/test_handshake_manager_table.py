"""HandshakeManager over the inproc backend: each address's entry lives through ``HANDSHAKE_TABLE``
(split from ``test_handshake_manager.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvwire.errors import (
    HandshakeTimeout,
    PeerUnreachable,
)
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import PeerAddress
from kvwire.kv.spec import KVSpec
from kvwire.protocol.states import HandshakeState
from kvwire.testing.handshake_env import SilentListener, build_registered_engine, manager_pair
from kvwire.testing.procs import free_port
from kvwire.transport.base import PeerMode
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=4, kv_heads=2, head_dim=8, block_size=4)
HOST = "127.0.0.1"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))  # type: ignore[arg-type]


def test_entry_states_follow_the_handshake_table() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.UNKNOWN
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.NOTIF_ONLY
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)  # UPGRADE, LOADED_FULL
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.FULL
            # A refresh that finds the same life changes nothing.
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY, incarnation="an-older-life")
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.FULL
            assert t.mgr.stats.replaced == 0
            t.mgr.forget("P")
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.REMOVED
            # Used again: a new life of the entry.
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.FULL
            await t.mgr.close()
            assert t.mgr.state(HOST, t.port, 0, 0) is HandshakeState.UNKNOWN

    run(body)


def test_a_failed_fetch_is_failed_and_fetched_again_later() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=5.0, retries=0, clock_samples=1)
        port = free_port()
        with pytest.raises(PeerUnreachable):
            await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY)
        assert mgr.state(HOST, port, 0, 0) is HandshakeState.FAILED
        async with SideChannelServer(p_info, p_ranks, port=port):
            await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY)  # FAILED -> FETCHING -> NOTIF_ONLY
            assert mgr.state(HOST, port, 0, 0) is HandshakeState.NOTIF_ONLY
        await mgr.close()

    run(body)


def test_a_fetch_in_flight_is_fetching_until_its_deadline_fails_it() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=0.3, retries=0)
        async with SilentListener() as silent:
            task = asyncio.create_task(mgr.ensure(HOST, silent.port, 0, 0, PeerMode.NOTIF_ONLY))
            for _ in range(5):
                await asyncio.sleep(0)
            assert mgr.state(HOST, silent.port, 0, 0) is HandshakeState.FETCHING
            with pytest.raises(HandshakeTimeout):
                await task
            assert mgr.state(HOST, silent.port, 0, 0) is HandshakeState.FAILED
        await mgr.close()

    run(body)


def test_a_failed_upgrade_keeps_the_notif_only_entry() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1, retries=0) as t:
            first = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            port = t.port
            await t.server.close()
            with pytest.raises(PeerUnreachable):
                await t.mgr.ensure(HOST, port, 0, 0, PeerMode.FULL)
            assert t.mgr.state(HOST, port, 0, 0) is HandshakeState.NOTIF_ONLY  # UPGRADE_FAILED
            assert t.mgr.peers() == [first]
            assert t.d_rank.agent.peer_mode(first.agent_name) is PeerMode.NOTIF_ONLY

    run(body)


def test_a_restarted_peer_gets_a_new_entry_life() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            old = t.mgr.core.machines[PeerAddress(HOST, t.port, 0, 0)]
            port = t.port
            await t.server.close()
            p2_info, p2_ranks = build_registered_engine("P", SPEC, 32, t.fabric.create_agent)
            async with SideChannelServer(p2_info, p2_ranks, port=port):
                await t.mgr.ensure(HOST, port, 0, 0, PeerMode.FULL)  # an upgrade that finds the new life
            assert old.state is HandshakeState.REMOVED
            assert t.mgr.state(HOST, port, 0, 0) is HandshakeState.FULL

    run(body)
