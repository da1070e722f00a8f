"""Real NIXL between two OS processes: P writes 4096 scattered 16 KiB blocks into D with a notification."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.errors import PeerDisconnected, PeerNotFound
from kvwire.testing.buffer_peer import BufferPeer, pattern
from kvwire.transport import Desc, PeerMode, XferHandle, XferOp, XferStatus, make_agent_name, new_incarnation
from kvwire.transport.nixl import NixlAgent

BLOCK = 16 << 10
N_BLOCKS = 4096
D_BLOCKS = 2 * N_BLOCKS
SEED = 11
WAIT_S = 30.0


def test_nixl_two_process_scattered_write() -> None:
    incarnation = new_incarnation()
    with BufferPeer(make_agent_name("itest-d", incarnation, 0, 0), D_BLOCKS * BLOCK) as d:
        p = NixlAgent(make_agent_name("itest-p", incarnation, 0, 0))
        try:
            src = pattern(N_BLOCKS * BLOCK, SEED)
            p.register(src)
            assert p.add_peer(d.metadata) == d.name
            assert p.peer_mode(d.name) is PeerMode.FULL
            rng = np.random.default_rng(SEED)
            src_idx = rng.permutation(N_BLOCKS)
            dst_idx = rng.choice(D_BLOCKS, size=N_BLOCKS, replace=False)
            local = p.prep_local([Desc(src.ctypes.data + i * BLOCK, BLOCK) for i in range(N_BLOCKS)])
            remote = p.prep_remote(d.name, [Desc(d.addr + i * BLOCK, BLOCK) for i in range(D_BLOCKS)])
            handle = p.post_prepped(XferOp.WRITE, local, src_idx.tolist(), remote, dst_idx.tolist(), b"kv:1")
            assert handle.nbytes == N_BLOCKS * BLOCK
            # D waits for the notification while P keeps progressing (which is what sends it).
            assert d.wait_notif(p.name, WAIT_S, pump=p.progress) == [b"kv:1"]
            assert p.status(handle) is XferStatus.DONE
            p.release(handle)
            result = d.verify(BLOCK, SEED, src.nbytes, src_idx.tolist(), dst_idx.tolist())
            assert result == {"checked_blocks": N_BLOCKS, "bad_blocks": 0, "dirty_untouched_blocks": 0}
        finally:
            p.close()


def test_nixl_two_process_dead_peer_is_typed() -> None:
    """After D is killed, a WRITE to it fails typed: post raises PeerDisconnected or status says FAILED."""
    incarnation = new_incarnation()
    with BufferPeer(make_agent_name("itest-dead-d", incarnation, 0, 0), 64 * BLOCK) as d:
        p = NixlAgent(make_agent_name("itest-dead-p", incarnation, 0, 0))
        try:
            src = pattern(BLOCK, SEED)
            p.register(src)
            p.add_peer(d.metadata)
            first = p.post(XferOp.WRITE, [Desc(src.ctypes.data, BLOCK)], [Desc(d.addr, BLOCK)], d.name)
            assert _settle(p, first) is XferStatus.DONE
            p.release(first)
            d.kill()
            outcome = None
            for _ in range(200):  # a few tries: NIXL may need one operation to notice the death
                try:
                    h = p.post(XferOp.WRITE, [Desc(src.ctypes.data, BLOCK)], [Desc(d.addr, BLOCK)], d.name)
                except PeerDisconnected:
                    outcome = "raised"
                    break
                state = _settle(p, h)
                p.release(h)
                if state is XferStatus.FAILED:
                    assert h.failed_reason
                    outcome = "failed"
                    break
                time.sleep(0.01)
            assert outcome is not None, "WRITEs to a killed peer kept succeeding"
            p.remove_peer(d.name)
            with pytest.raises(PeerNotFound):
                p.send_notif(d.name, b"x")
        finally:
            p.close()


def _settle(agent: NixlAgent, handle: XferHandle) -> XferStatus:
    deadline = time.monotonic() + WAIT_S
    state = agent.status(handle)
    while state is XferStatus.IN_PROGRESS and time.monotonic() < deadline:
        state = agent.status(handle)
    return state
