"""HandshakeManager over the inproc backend: modes, dedupe, upgrade, timeouts, retries, auth, restarts."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from kvwire.core.handshake_io import HsAction, HsInput, Sleep
from kvwire.errors import (
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    NoSuchRank,
    NotAddressable,
    PeerNotFound,
    PeerReplaced,
    PeerUnreachable,
    Unauthorized,
)
from kvwire.handshake.client import _stalled as stalled_note
from kvwire.handshake.client import fetch_metadata
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import FailureReason, PeerAddress
from kvwire.kv.spec import KVSpec, RegionKind
from kvwire.testing.handshake_env import SilentListener, build_registered_engine, manager_pair
from kvwire.testing.procs import free_port
from kvwire.transport.base import Desc, PeerMode, XferOp, XferStatus
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=4, kv_heads=2, head_dim=8, block_size=4)
HOST = "127.0.0.1"
SECRET = b"cluster-secret"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))  # type: ignore[arg-type]


def test_notif_only_handshake_loads_connection_only() -> None:
    async def body() -> None:
        async with manager_pair(SPEC) as t:
            peer = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            p_agent = t.p_ranks[0].agent
            assert peer.agent_name == p_agent.name
            assert (peer.engine_id, peer.incarnation) == ("P", t.p_info.incarnation)
            assert peer.mode is PeerMode.NOTIF_ONLY and peer.layout is None and peer.num_blocks == 32
            assert t.d_rank.agent.peer_mode(p_agent.name) is PeerMode.NOTIF_ONLY
            assert t.server.stats.replies["metadata"] == 0  # only connection metadata was ever asked for
            t.d_rank.agent.send_notif(peer.agent_name, b"hello")
            assert p_agent.drain_notifs() == {t.d_rank.agent.name: [b"hello"]}
            # The asymmetry: D cannot touch P's memory after a notif-only handshake.
            region = t.p_ranks[0].cache.regions()[0]
            local = t.d_rank.cache.regions()[0]
            with pytest.raises(NotAddressable):
                t.d_rank.agent.post(
                    XferOp.READ, [Desc(local.base_addr, 16)], [Desc(region.base_addr, 16)], peer.agent_name
                )
            assert t.mgr.stats.handshakes[PeerMode.NOTIF_ONLY] == 1

    run(body)


def test_full_handshake_makes_memory_addressable_with_region_addresses() -> None:
    async def body() -> None:
        async with manager_pair(SPEC) as t:
            peer = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            assert peer.mode is PeerMode.FULL and peer.layout is not None
            p_cache = t.p_ranks[0].cache
            assert peer.layout.regions == tuple(p_cache.regions())
            assert t.d_rank.agent.peer_mode(peer.agent_name) is PeerMode.FULL
            # Write D's block 3 of layer 1/V into P's block 7 using only the layout's base address.
            d_cache = t.d_rank.cache
            d_cache.v(1)[3] = np.arange(d_cache.v(1)[3].size).reshape(d_cache.v(1)[3].shape)
            remote = peer.layout.region(1, RegionKind.V)
            src = d_cache.regions()[3]
            assert (src.layer, src.kind) == (1, RegionKind.V)
            handle = t.d_rank.agent.post(
                XferOp.WRITE,
                [Desc(src.base_addr + 3 * src.block_len, src.block_len)],
                [Desc(remote.base_addr + 7 * remote.block_len, remote.block_len)],
                peer.agent_name,
            )
            for _ in range(100):
                if t.d_rank.agent.status(handle) is not XferStatus.IN_PROGRESS:
                    break
            assert t.d_rank.agent.status(handle) is XferStatus.DONE
            assert (
                p_cache.block_bytes_view(1, RegionKind.V, 7).tobytes()
                == d_cache.block_bytes_view(1, RegionKind.V, 3).tobytes()
            )

    run(body)


def test_ten_concurrent_callers_share_one_fetch() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            peers = await asyncio.gather(
                *(t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL) for _ in range(10))
            )
            assert all(p is peers[0] for p in peers)
            assert t.server.stats.connections == 1 and t.server.stats.replies["metadata"] == 1
            assert t.mgr.stats.deduped == 9 and t.mgr.stats.handshakes[PeerMode.FULL] == 1
            # Later callers are cache hits: no new connection.
            assert await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY) is peers[0]
            assert t.server.stats.connections == 1 and t.mgr.stats.cache_hits == 1

    run(body)


def test_upgrade_does_only_the_missing_part() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=3, clock_rtt_target_s=0.0) as t:
            first = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert t.server.stats.replies["notif_only"] == 3  # the request and two more clock samples
            full = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            # One full request, no new clock samples, the agent upgraded in place.
            assert t.server.stats.replies["metadata"] == 1 and t.server.stats.replies["notif_only"] == 3
            assert full.mode is PeerMode.FULL and full.clock_offset_s == first.clock_offset_s
            assert t.d_rank.agent.peer_mode(full.agent_name) is PeerMode.FULL
            assert t.mgr.stats.upgrades == 1
            assert (
                t.mgr.stats.handshakes[PeerMode.NOTIF_ONLY] == 1
                and t.mgr.stats.handshakes[PeerMode.FULL] == 1
            )
            assert t.mgr.peers() == [full]

    run(body)


def test_full_caller_joining_a_notif_only_handshake_gets_an_upgrade() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            notif, full, notif2 = await asyncio.gather(
                t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY),
                t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL),
                t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY),
            )
            assert notif.mode is PeerMode.NOTIF_ONLY and notif2 is notif
            assert full.mode is PeerMode.FULL
            assert t.mgr.stats.upgrades == 1 and t.server.stats.connections == 2

    run(body)


def test_handshakes_with_different_ranks_run_separately() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, p_tp=2, p_pp=2, clock_samples=1) as t:
            peers = await asyncio.gather(
                *(
                    t.mgr.ensure(HOST, t.port, pp, tp, PeerMode.NOTIF_ONLY)
                    for pp in range(2)
                    for tp in range(2)
                )
            )
            assert sorted((p.pp_rank, p.tp_rank) for p in peers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
            assert len({p.agent_name for p in peers}) == 4
            assert t.server.stats.connections == 4
            with pytest.raises(NoSuchRank):
                await t.mgr.ensure(HOST, t.port, 2, 0, PeerMode.NOTIF_ONLY)
            assert t.mgr.stats.failures[FailureReason.NO_SUCH_RANK] == 1

    run(body)


def test_full_handshake_with_a_pp_stage_validates_its_layer_window() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, p_pp=2, clock_samples=1) as t:
            peer = await t.mgr.ensure(HOST, t.port, 1, 0, PeerMode.FULL)
            assert peer.layout is not None and peer.layout.layers == range(2, 4)
            assert len(peer.layout.regions) == 4

    run(body)


def test_a_peer_whose_layout_is_refused_is_not_left_loaded() -> None:
    # Same model, so the compat hashes agree, but D's block size does not divide P's: the layout check
    # refuses it. It ran after the agent was loaded, and nothing unloaded it (the peer never reaches the
    # cache, so reaping never found it): a remote agent and its endpoint per such handshake, for good.
    async def body() -> None:
        fabric = InprocFabric()
        p_info, p_ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        odd = KVSpec(num_layers=4, kv_heads=2, head_dim=8, block_size=3)
        d_info, d_ranks = build_registered_engine("D", odd, 16, fabric.create_agent)
        server = SideChannelServer(d_info, d_ranks)
        await server.start()
        mgr = HandshakeManager(p_info, p_ranks[0], timeout_s=2.0, retries=0, clock_samples=1)
        try:
            with pytest.raises(IncompatiblePeer, match="block sizes"):
                await mgr.ensure(HOST, server.port, 0, 0, PeerMode.FULL)
            assert p_ranks[0].agent.peer_mode(d_ranks[0].agent.name) is None
            assert not mgr.core.peers
        finally:
            await mgr.close()
            await server.close()

    run(body)


def test_timeout_against_a_listener_that_never_answers() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=0.3, retries=3)
        async with SilentListener() as silent:
            started = time.monotonic()
            with pytest.raises(HandshakeTimeout):
                await mgr.ensure(HOST, silent.port, 0, 0, PeerMode.NOTIF_ONLY)
            took = time.monotonic() - started
            # A hung connection gets another within the deadline (the first had half the budget), and the
            # whole handshake still ends at the deadline.
            assert silent.accepted >= 2 and took < 0.3 + 0.2
        assert mgr.stats.failures[FailureReason.TIMEOUT] == 1 and mgr.peers() == []
        await mgr.close()

    run(body)


def test_a_timeout_says_when_this_side_s_loop_was_stalled() -> None:
    """A timeout that fires late was this process's stall, not the peer's silence: its message says so
    (the timeout's callback runs before the read it cancels, so an answer may have come unread)."""

    async def body() -> None:
        async with SilentListener() as silent:
            asyncio.get_running_loop().call_later(0.15, time.sleep, 0.5)  # a thread holding the GIL
            with pytest.raises(HandshakeTimeout) as err:
                await fetch_metadata(
                    PeerAddress(HOST, silent.port, 0, 0), notif_only=True, compat_hash="x", timeout_s=0.2
                )
            late = re.search(
                r"fired (\d+\.\d+) s late: this process's event loop was stalled", str(err.value)
            )
            assert late is not None and float(late.group(1)) >= 0.3, err.value  # stalled 0.45 s past it

    run(body)
    # On time (a loop's timers run about a millisecond late), the message blames no one.
    assert stalled_note(0.01) == "" and "stalled" in stalled_note(0.3)


def test_refused_connection_is_retried_a_bounded_number_of_times() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=5.0, retries=2, backoff_s=0.01)
        with pytest.raises(PeerUnreachable):
            await mgr.ensure(HOST, free_port(), 0, 0, PeerMode.NOTIF_ONLY)
        assert mgr.stats.retries == 2 and mgr.stats.failures[FailureReason.UNREACHABLE] == 1
        await mgr.close()

    run(body)


def test_peer_that_comes_up_during_retries_is_reached() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        p_info, p_ranks = build_registered_engine("P", SPEC, 8, fabric.create_agent)
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=10.0, retries=50, backoff_s=0.01)
        port = free_port()
        # An event, not a polling sleep: set when the core decides to back off and retry.
        retrying = asyncio.Event()
        handle = mgr.core.handle

        def spy(now: float, inp: HsInput) -> list[HsAction]:
            out = handle(now, inp)
            if any(isinstance(a, Sleep) for a in out):
                retrying.set()
            return out

        mgr.core.handle = spy  # type: ignore[method-assign]
        task = asyncio.create_task(mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY))
        await asyncio.wait_for(retrying.wait(), 10.0)
        async with SideChannelServer(p_info, p_ranks, port=port):
            peer = await task
        assert peer.engine_id == "P" and mgr.stats.retries >= 1
        assert mgr.stats.failures.total() == 0
        await mgr.close()

    run(body)


def test_incompatible_compat_hash_is_refused_without_retry() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, p_model="another-model") as t:
            with pytest.raises(IncompatiblePeer, match="compat hash"):
                await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert t.server.stats.connections == 1 and t.mgr.stats.retries == 0
            assert t.mgr.stats.failures[FailureReason.INCOMPATIBLE] == 1
            assert t.d_rank.agent.peer_mode(t.p_ranks[0].agent.name) is None

    run(body)


def test_expected_engine_id_is_checked() -> None:
    async def body() -> None:
        async with manager_pair(SPEC) as t:
            # Another engine at the address than the one named: the named one is gone (peer_dead).
            with pytest.raises(PeerReplaced, match="not Q: that engine restarted under a new id"):
                await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY, engine_id="Q")
            assert (
                await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY, engine_id="P")
            ).engine_id == "P"

    run(body)


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "ok"),
    [(SECRET, SECRET, True), (SECRET, b"wrong", False), (SECRET, None, False), (None, SECRET, False)],
    ids=["good", "bad", "missing", "server-open"],
)
def test_auth(server_secret: bytes | None, client_secret: bytes | None, ok: bool) -> None:
    """server-open: a client holding a secret refuses metadata that is not sealed with it (the side that
    answered cannot show it holds the secret: an impostor on the peer's address looks the same)."""

    async def body() -> None:
        async with manager_pair(
            SPEC,
            server_secret=server_secret,
            client_secret=client_secret,
            clock_samples=3,
            clock_rtt_target_s=0.0,
        ) as t:
            if ok:
                peer = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
                assert peer.mode is PeerMode.FULL
            else:
                with pytest.raises(Unauthorized):
                    await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
                assert t.mgr.stats.failures[FailureReason.UNAUTHORIZED] == 1 and t.mgr.stats.retries == 0

    run(body)


def test_restarted_peer_with_new_incarnation_replaces_the_old() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            old = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            port = t.port
            await t.server.close()
            # P restarts on the same port: new incarnation, new agent name, new buffers.
            p2_info, p2_ranks = build_registered_engine("P", SPEC, 32, t.fabric.create_agent)
            async with SideChannelServer(p2_info, p2_ranks, port=port):
                # The cached entry serves callers that do not know better...
                assert await t.mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY) is old
                # ...a caller that saw the new incarnation (e.g. in a push_reg) gets it refreshed.
                new = await t.mgr.ensure(
                    HOST, port, 0, 0, PeerMode.NOTIF_ONLY, incarnation=p2_info.incarnation
                )
                assert new.incarnation == p2_info.incarnation != old.incarnation
                assert new.agent_name == p2_ranks[0].agent.name != old.agent_name
                assert t.d_rank.agent.peer_mode(old.agent_name) is None
                assert t.d_rank.agent.peer_mode(new.agent_name) is PeerMode.NOTIF_ONLY
                assert t.mgr.peers() == [new] and t.mgr.stats.replaced == 1

    run(body)


def test_upgrade_that_finds_a_restarted_peer_reloads_it_in_full() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            old = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            port = t.port
            await t.server.close()
            p2_info, p2_ranks = build_registered_engine("P", SPEC, 32, t.fabric.create_agent)
            async with SideChannelServer(p2_info, p2_ranks, port=port):
                new = await t.mgr.ensure(HOST, port, 0, 0, PeerMode.FULL)
            assert new.incarnation == p2_info.incarnation and new.mode is PeerMode.FULL
            assert new.layout is not None and new.layout.regions == tuple(p2_ranks[0].cache.regions())
            assert t.d_rank.agent.peer_mode(old.agent_name) is None
            assert t.mgr.stats.replaced == 1 and t.mgr.stats.upgrades == 0

    run(body)


def test_forget_and_reap_remove_agents() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, p_tp=2, clock_samples=1) as t:
            a = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            b = await t.mgr.ensure(HOST, t.port, 0, 1, PeerMode.FULL)
            t.mgr.forget("P")
            assert t.mgr.peers() == []
            for name in (a.agent_name, b.agent_name):
                assert t.d_rank.agent.peer_mode(name) is None
                with pytest.raises(PeerNotFound):
                    t.d_rank.agent.send_notif(name, b"x")
            assert t.mgr.stats.forgotten == 1
            # Reap: a peer untouched past the TTL goes; a fresh one stays.
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            t.mgr.touch("P", 100.0)
            assert t.mgr.reap_idle(now=150.0, ttl_s=60.0) == []
            assert t.mgr.reap_idle(now=161.0, ttl_s=60.0) == ["P"]
            assert t.mgr.peers() == [] and t.mgr.reap_idle(now=500.0, ttl_s=60.0) == []
            # A forgotten peer is handshaken again on demand.
            assert (await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)).engine_id == "P"
            assert t.mgr.stats.handshakes[PeerMode.NOTIF_ONLY] == 3

    run(body)


def test_cancelled_caller_does_not_cancel_the_shared_handshake() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            first = asyncio.create_task(t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY))
            second = asyncio.create_task(t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY))
            await asyncio.sleep(0)
            first.cancel()
            peer = await second
            assert peer.engine_id == "P" and first.cancelled()
            assert t.mgr.stats.handshakes[PeerMode.NOTIF_ONLY] == 1

    run(body)


def test_one_info_line_per_handshake(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)  # cache hit: no line

    with caplog.at_level(logging.INFO, logger="kvwire.handshake"):
        run(body)
    records = [r for r in caplog.records if r.getMessage().startswith("handshake ")]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]
    lines = [r.getMessage() for r in records]
    assert "mode=notif_only" in lines[0] and "mode=full (upgrade)" in lines[1]
    for line in lines:
        assert "rank=pp0/tp0" in line and "engine=P/" in line and "agent=P/" in line
        for step in ("fetch=", "load=", "prepare=", "total="):
            assert step in line


def test_one_warning_line_per_failed_handshake(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1, p_model="other-model") as t:
            with pytest.raises(IncompatiblePeer):
                await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)

    with caplog.at_level(logging.INFO, logger="kvwire.handshake"):
        run(body)
    records = [r for r in caplog.records if r.getMessage().startswith("handshake ")]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    line = records[0].getMessage()
    assert "failed: reason=incompatible mode=notif_only" in line and "compat hash" in line


def test_close_unloads_every_peer() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            peer = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            await t.mgr.close()
            assert t.mgr.peers() == [] and t.d_rank.agent.peer_mode(peer.agent_name) is None

    run(body)


def test_clock_samples_stop_once_a_round_trip_is_short_enough() -> None:
    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=5, clock_rtt_target_s=60.0) as t:
            peer = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert t.server.stats.replies["notif_only"] == 1
            # Same process, same clock: the offset is within half a round trip of zero.
            assert abs(peer.clock_offset_s) < 1.0

    run(body)


def test_a_reply_carrying_a_loaded_peers_metadata_under_another_name_leaves_that_peer_loaded() -> None:
    """A listener relaying a live peer's metadata under another agent name: the load names the live peer,
    the mismatch is refused, and the live peer was unloaded (every later write or notification to it
    failed ``PeerNotFound`` while the cache still listed it)."""

    async def body() -> None:
        async with manager_pair(SPEC, clock_samples=1) as t:
            real = await t.mgr.ensure(HOST, t.port, 0, 0, PeerMode.FULL)
            relay_info, relay_ranks = build_registered_engine("R", SPEC, 8, t.fabric.create_agent)
            relay_agent = relay_ranks[0].agent
            relay_agent.metadata = t.p_ranks[0].agent.metadata  # type: ignore[method-assign]
            async with SideChannelServer(relay_info, relay_ranks) as relay:
                with pytest.raises(HandshakeError, match="metadata loads agent"):
                    await t.mgr.ensure(HOST, relay.port, 0, 0, PeerMode.FULL)
            assert t.d_rank.agent.peer_mode(real.agent_name) is PeerMode.FULL
            assert t.mgr.peers() == [real]

    run(body)


@pytest.mark.parametrize("host", ["a\x00b", "x" * 64 + ".example"])
def test_a_host_no_resolver_takes_is_unreachable_not_an_untyped_error(host: str) -> None:
    """A NUL or a 64-character label raised ``ValueError``/``UnicodeError`` out of the fetch: not
    counted as a handshake failure, and logged at ERROR with the whole host."""

    async def body() -> None:
        with pytest.raises(PeerUnreachable, match="bad host"):
            await fetch_metadata(
                PeerAddress(host, 7000, 0, 0), notif_only=True, compat_hash="x", timeout_s=2.0
            )

    run(body)


def test_a_port_past_65535_is_unreachable_not_an_overflow() -> None:
    """A peer address past the last port (a rank's port computed from a hostile base) raised
    ``OverflowError`` out of the fetch, past every handler that counts handshake failures."""

    async def body() -> None:
        with pytest.raises(PeerUnreachable, match="bad host or port: OverflowError"):
            await fetch_metadata(
                PeerAddress(HOST, 65536, 0, 1), notif_only=True, compat_hash="x", timeout_s=2.0
            )

    run(body)
