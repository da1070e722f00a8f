"""Handshakes over real NIXL with the side-channel server in another process.

D loads P notif-only: notifications reach P, P's memory is not addressable. D then upgrades to full and
reads one of P's blocks by the region's base address (no prepared list), byte for byte against P's pattern.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time

import numpy as np
import pytest

from kvwire.errors import NotAddressable, Unauthorized
from kvwire.handshake.manager import HandshakeManager
from kvwire.kv.cache import KVCache
from kvwire.kv.spec import KVSpec, RegionKind
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.testing.side_channel_peer import SideChannelPeer, fill_pattern
from kvwire.transport.base import Agent, Desc, PeerMode, XferOp, XferStatus

pytestmark = pytest.mark.nixl

SPEC = KVSpec(num_layers=4, kv_heads=2, head_dim=16, block_size=4)
P_BLOCKS = 64
SEED = 5
SECRET = b"integration-secret"
HOST = "127.0.0.1"


def _peer_args() -> list[str]:
    return ["--engine-id", "P", "--blocks", str(P_BLOCKS), "--seed", str(SEED), "--secret", SECRET.hex()]


def _wait_done(agent: Agent, handle: object) -> XferStatus:
    deadline = time.monotonic() + 30
    state = XferStatus.IN_PROGRESS
    while time.monotonic() < deadline:
        state = agent.status(handle)  # type: ignore[arg-type]
        if state is not XferStatus.IN_PROGRESS:
            break
        agent.progress()
        time.sleep(0.001)
    return state


def test_notif_only_then_upgrade_over_real_nixl() -> None:
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from kvwire.transport.nixl import NixlAgent

    with SideChannelPeer(*_peer_args()) as p:
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, NixlAgent)
        d = d_ranks[0]

        async def scenario() -> None:
            mgr = HandshakeManager(d_info, d, secret=SECRET)
            stranger = HandshakeManager(d_info, d, secret=b"wrong")
            try:
                with pytest.raises(Unauthorized):
                    await stranger.ensure(HOST, p.port, 0, 0, PeerMode.NOTIF_ONLY)
                peer = await mgr.ensure(HOST, p.port, 0, 0, PeerMode.NOTIF_ONLY)
                assert (
                    peer.incarnation == p.incarnation
                    and d.agent.peer_mode(peer.agent_name) is PeerMode.NOTIF_ONLY
                )
                d.agent.send_notif(peer.agent_name, b"KVW-test hello")
                deadline = time.monotonic() + 30
                while True:  # progress D until P reports the notification
                    d.agent.progress()
                    try:
                        words = await asyncio.to_thread(p.expect, "NOTIF", 0.05)
                        break
                    except TimeoutError:
                        assert time.monotonic() < deadline
                assert words[1:] == [d.agent.name, b"KVW-test hello".hex()]

                p_region = (1, RegionKind.V)
                local = d.cache.regions()[0]
                with pytest.raises(NotAddressable):
                    d.agent.post(
                        XferOp.READ, [Desc(local.base_addr, local.block_len)], [Desc(1, 1)], peer.agent_name
                    )

                full = await mgr.ensure(HOST, p.port, 0, 0, PeerMode.FULL)
                assert full.mode is PeerMode.FULL and mgr.stats.upgrades == 1
                assert full.layout is not None
                remote = full.layout.region(*p_region)
                assert remote.block_len == local.block_len
                handle = d.agent.post(
                    XferOp.READ,
                    [Desc(local.base_addr + 2 * local.block_len, local.block_len)],
                    [Desc(remote.base_addr + 9 * remote.block_len, remote.block_len)],
                    full.agent_name,
                )
                assert _wait_done(d.agent, handle) is XferStatus.DONE
                d.agent.release(handle)
                expected = KVCache(SPEC, P_BLOCKS)
                fill_pattern(expected, SEED)
                got = d.cache.block_bytes_view(local.layer, local.kind, 2).tobytes()
                assert got == expected.block_bytes_view(*p_region, 9).tobytes()
                assert np.count_nonzero(d.cache.block_bytes_view(local.layer, local.kind, 1)) == 0
            finally:
                await mgr.close()
                await stranger.close()

        try:
            asyncio.run(asyncio.wait_for(scenario(), 60))
        finally:
            d.agent.close()


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed between the listing and the read
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def test_an_agent_warms_up_once_for_every_start_of_its_connectors() -> None:
    """NIXL keeps the TCP connection of an unloaded peer that is still alive, and the warm-up loads and
    unloads one (the process's throwaway agent): every connector start on the same agents left two more
    sockets open for good (measured 22 -> 34 over six starts before)."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from kvwire.transport.nixl import NixlAgent

    agent = NixlAgent("warm/once/pp0/tp0")
    try:
        agent.warm_up()
        gc.collect()  # sockets an earlier test left to the collector go now, not during the count
        after_first = _sockets()
        for _ in range(8):
            agent.warm_up()
        # Two more per warm-up before (16 here); the rest of the process (an earlier test's threads) may
        # open or close one meanwhile: CI saw 45 -> 46 with the fix in.
        assert _sockets() - after_first <= 2
    finally:
        agent.close()
