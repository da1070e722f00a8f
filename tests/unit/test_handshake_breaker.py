"""The per-address circuit breaker: a handshake that failed on the network makes the next ones with that
address fail at once for a growing window; refusals and refused connections do not trip it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from kvwire.errors import CircuitOpen, HandshakeTimeout, PeerUnreachable
from kvwire.handshake.breaker import CircuitBreaker
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec
from kvwire.testing.handshake_env import SilentListener, build_registered_engine
from kvwire.transport.base import PeerMode
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
HOST = "127.0.0.1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_windows_double_up_to_the_cap_and_success_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(base_s=1.0, max_s=4.0, clock=clock)
    b.check("h", 1)  # nothing known: allowed
    assert [b.failed("h", 1) for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    with pytest.raises(CircuitOpen, match="4 handshake"):
        b.check("h", 1)
    b.check("h", 2)  # another port of the same host is another address
    clock.now += 4.0
    b.check("h", 1)  # the window passed: a probe may go
    b.succeeded("h", 1)
    assert not b.is_open("h", 1) and len(b) == 0
    assert b.fast_failures == 1 and b.opened == 4


def test_the_table_is_bounded() -> None:
    b = CircuitBreaker(max_entries=8, clock=Clock())
    for port in range(100):
        b.failed("h", port)
    assert len(b) == 8 and b.evicted == 92
    assert b.is_open("h", 99) and not b.is_open("h", 0)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_a_timed_out_address_fails_fast_until_its_window_passes() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        clock = Clock()
        breaker = CircuitBreaker(base_s=5.0)
        # The manager's clock is the one the breaker's windows are measured in (one injected clock).
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=0.3, retries=0, breaker=breaker, clock=clock)
        async with SilentListener() as silent:
            with pytest.raises(HandshakeTimeout):
                await mgr.ensure(HOST, silent.port, 0, 0, PeerMode.NOTIF_ONLY)
            t0 = time.monotonic()
            for rank in range(20):  # a burst of requests naming the dead address: none waits
                with pytest.raises(CircuitOpen):
                    await mgr.ensure(HOST, silent.port, 0, rank % 2, PeerMode.NOTIF_ONLY)
            assert time.monotonic() - t0 < 0.1
            assert breaker.fast_failures == 20
            clock.now += 5.0  # the window passed: the next call probes, times out, and reopens for 10 s
            with pytest.raises(HandshakeTimeout):
                await mgr.ensure(HOST, silent.port, 0, 0, PeerMode.NOTIF_ONLY)
            clock.now += 9.0
            with pytest.raises(CircuitOpen, match="2 handshake"):
                await mgr.ensure(HOST, silent.port, 0, 0, PeerMode.NOTIF_ONLY)
        await mgr.close()

    _run(body())


def test_a_refused_connection_does_not_trip_it_and_success_clears_it() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=2.0, retries=0, clock_samples=1)
        async with SideChannelServer(p_info, p_ranks, port=0) as server:
            port = server.port
        with pytest.raises(PeerUnreachable):  # nobody listens there now: a fast failure
            await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY)
        assert not mgr.breaker.is_open(HOST, port)
        async with SideChannelServer(p_info, p_ranks, port=port):  # the peer is back at once
            peer = await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY)
        assert peer.engine_id == "P" and len(mgr.breaker) == 0
        await mgr.close()

    _run(body())


def test_a_trip_does_not_hold_a_caller_after_another_incarnation() -> None:
    clock = Clock()
    b = CircuitBreaker(base_s=1.0, max_s=30.0, clock=clock)
    for _ in range(5):
        b.failed("h", 1, "P-life1")  # 16 s
    for life in ("P-life1", None):  # the same life, or a caller that does not know: held
        with pytest.raises(CircuitOpen, match="5 handshake"):
            b.check("h", 1, life)
    b.check("h", 1, "P-life2")  # the peer restarted there: not held
    assert b.failed("h", 1, "P-life2") == 1.0  # the new life's own failure starts a fresh window
    with pytest.raises(CircuitOpen, match="1 handshake"):
        b.check("h", 1, "P-life2")
    b.check("h", 1, "P-life1")


def test_a_peer_restarted_on_a_tripped_address_is_handshaken_at_once() -> None:
    """The old life timed out and tripped the address for 30 s; the new life, named by the caller, is
    dialled (and served) at once instead of failing CircuitOpen until the window ends."""

    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent, incarnation="P-life2")
        breaker = CircuitBreaker(base_s=30.0)
        mgr = HandshakeManager(
            d_info, d_ranks[0], timeout_s=0.3, retries=0, clock_samples=1, breaker=breaker, clock=Clock()
        )
        async with SilentListener() as silent:  # the old life hangs
            port = silent.port
            with pytest.raises(HandshakeTimeout):
                await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY, incarnation="P-life1")
        with pytest.raises(CircuitOpen):
            await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY, incarnation="P-life1")
        async with SideChannelServer(p_info, p_ranks, port=port):
            peer = await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY, incarnation="P-life2")
        assert peer.incarnation == "P-life2" and not breaker.is_open(HOST, port)
        await mgr.close()

    _run(body())
