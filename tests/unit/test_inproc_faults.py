"""The inproc backend's checks and fault injection."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.errors import (
    AgentClosed,
    ConfigError,
    NotAddressable,
    PeerDisconnected,
    TransferFailed,
)
from kvwire.transport import Desc, XferHandle, XferOp, XferStatus, array_desc
from kvwire.transport.inproc import InprocAgent, InprocFabric, InprocFaults
from kvwire.transport.registry import create_agent

BLOCK = 1024


def _setup(
    faults: InprocFaults | None = None,
) -> tuple[InprocFabric, InprocAgent, InprocAgent, tuple[np.ndarray, np.ndarray]]:
    fabric = InprocFabric()
    p = fabric.create_agent("p", faults)
    d = fabric.create_agent("d")
    src = np.arange(4 * BLOCK, dtype=np.uint32).view(np.uint8)[: 4 * BLOCK].copy()
    dst = np.zeros(4 * BLOCK, dtype=np.uint8)
    p.register(src)
    d.register(dst)
    p.add_peer(d.metadata())
    d.add_peer(p.conn_metadata())
    return fabric, p, d, (src, dst)


def _write(p: InprocAgent, bufs: tuple[np.ndarray, np.ndarray], notif: bytes | None = None) -> XferHandle:
    src, dst = bufs
    return p.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], "d", notif=notif)


def test_write_copies_real_bytes() -> None:
    fabric = InprocFabric()
    p, d = fabric.create_agent("p"), fabric.create_agent("d")
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
    p.register(src)
    d.register(dst)
    p.add_peer(d.metadata())
    h = p.post(XferOp.WRITE, [Desc(src.ctypes.data + 16, 32)], [Desc(dst.ctypes.data + 100, 32)], "d")
    assert p.status(h) is XferStatus.DONE
    assert np.array_equal(dst[100:132], src[16:48])
    assert not dst[:100].any() and not dst[132:].any()


def test_delay_by_calls_holds_data_and_notif() -> None:
    fabric = InprocFabric()
    p = fabric.create_agent("p", InprocFaults(delay_calls=3))
    d = fabric.create_agent("d")
    src, dst = np.full(BLOCK, 7, dtype=np.uint8), np.zeros(BLOCK, dtype=np.uint8)
    p.register(src)
    d.register(dst)
    p.add_peer(d.metadata())
    h = p.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], "d", notif=b"n")
    assert p.status(h) is XferStatus.IN_PROGRESS
    p.progress()
    assert not dst.any() and d.drain_notifs() == {}
    assert p.status(h) is XferStatus.DONE
    assert np.array_equal(dst, src)
    assert d.drain_notifs() == {"p": [b"n"]}


def test_delay_by_time() -> None:
    fabric = InprocFabric()
    p = fabric.create_agent("p", InprocFaults(delay_s=0.3))
    d = fabric.create_agent("d")
    src, dst = np.ones(BLOCK, dtype=np.uint8), np.zeros(BLOCK, dtype=np.uint8)
    p.register(src)
    d.register(dst)
    p.add_peer(d.metadata())
    h = p.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], "d")
    assert p.status(h) is XferStatus.IN_PROGRESS
    for _ in range(200):
        if p.status(h) is XferStatus.DONE:
            break
        time.sleep(0.01)
    assert p.status(h) is XferStatus.DONE
    assert dst.all()


def test_injected_failure_copies_nothing() -> None:
    _fabric, p, d, bufs = _setup(InprocFaults(fail_transfers=1))
    h = p.post(XferOp.WRITE, [array_desc(bufs[0])], [array_desc(bufs[1])], "d", notif=b"n")
    assert p.status(h) is XferStatus.FAILED
    assert h.failed_reason
    assert not bufs[1].any()
    assert d.drain_notifs() == {}
    h2 = p.post(XferOp.WRITE, [array_desc(bufs[0])], [array_desc(bufs[1])], "d")
    assert p.status(h2) is XferStatus.DONE


def test_notif_drop_duplicate_reorder() -> None:
    faults = InprocFaults(drop_notifs=1)
    fabric = InprocFabric()
    p, d = fabric.create_agent("p", faults), fabric.create_agent("d")
    p.add_peer(d.conn_metadata())
    p.send_notif("d", b"lost")
    p.send_notif("d", b"kept")
    assert d.drain_notifs() == {"p": [b"kept"]}
    faults.duplicate_notifs = 1
    p.send_notif("d", b"twice")
    p.send_notif("d", b"once")
    assert d.drain_notifs() == {"p": [b"twice", b"twice", b"once"]}
    faults.reorder_notifs = 3
    for msg in (b"1", b"2"):
        p.send_notif("d", msg)
    assert d.drain_notifs() == {}
    p.send_notif("d", b"3")
    p.send_notif("d", b"4")
    assert d.drain_notifs() == {"p": [b"3", b"2", b"1", b"4"]}


def test_notif_rates_are_seeded() -> None:
    fabric = InprocFabric()
    p = fabric.create_agent("p", InprocFaults(drop_rate=1.0))
    q = fabric.create_agent("q", InprocFaults(duplicate_rate=1.0))
    d = fabric.create_agent("d")
    p.add_peer(d.conn_metadata())
    q.add_peer(d.conn_metadata())
    p.send_notif("d", b"x")
    q.send_notif("d", b"y")
    assert d.drain_notifs() == {"q": [b"y", b"y"]}


def test_kill_peer() -> None:
    fabric, p, d, bufs = _setup(InprocFaults(delay_calls=2))
    in_flight = _write(p, bufs, b"n")
    fabric.kill("d")
    assert p.status(in_flight) is XferStatus.FAILED
    assert not bufs[1].any()
    with pytest.raises(PeerDisconnected):
        _write(p, bufs)
    with pytest.raises(PeerDisconnected):
        p.send_notif("d", b"x")
    with pytest.raises(AgentClosed):
        d.drain_notifs()
    # The rest of the fabric keeps working.
    e = fabric.create_agent("e")
    sink = np.zeros(4 * BLOCK, dtype=np.uint8)
    e.register(sink)
    p.add_peer(e.metadata())
    h = p.post(XferOp.WRITE, [array_desc(bufs[0])], [array_desc(sink)], "e")
    p.progress()
    p.progress()
    assert p.status(h) is XferStatus.DONE
    assert np.array_equal(sink, bufs[0])


def test_closed_peer_is_disconnected() -> None:
    _fabric, p, d, bufs = _setup()
    d.close()
    with pytest.raises(PeerDisconnected):
        _write(p, bufs)


def test_bounds_are_checked() -> None:
    _fabric, p, _d, bufs = _setup()
    src, dst = bufs
    with pytest.raises(NotAddressable):
        p.post(XferOp.WRITE, [Desc(src.ctypes.data, 64)], [Desc(dst.ctypes.data + dst.nbytes - 32, 64)], "d")
    with pytest.raises(NotAddressable):
        p.post(XferOp.WRITE, [Desc(src.ctypes.data - 64, 64)], [Desc(dst.ctypes.data, 64)], "d")
    with pytest.raises(NotAddressable):
        p.prep_remote("d", [Desc(dst.ctypes.data + dst.nbytes, 1)])
    with pytest.raises(TransferFailed):
        p.post(XferOp.WRITE, [Desc(src.ctypes.data, 64)], [Desc(dst.ctypes.data, 32)], "d")
    local, far = p.prep_local([array_desc(src)]), p.prep_remote("d", [array_desc(dst)])
    with pytest.raises(TransferFailed):
        p.post_prepped(XferOp.WRITE, local, [1], far, [0])
    assert not dst.any()


def test_target_deregistered_before_copy_fails() -> None:
    _fabric, p, d, bufs = _setup(InprocFaults(delay_calls=1))
    h = _write(p, bufs)
    d.deregister(next(iter(d._regs.values()))[0])
    assert p.status(h) is XferStatus.FAILED
    assert not bufs[1].any()


def test_release_in_flight_cancels() -> None:
    _fabric, p, d, bufs = _setup(InprocFaults(delay_calls=2))
    h = _write(p, bufs, b"n")
    p.release(h)
    for _ in range(3):
        p.progress()
    assert not bufs[1].any()
    assert d.drain_notifs() == {}


def test_factory() -> None:
    fabric = InprocFabric()
    agent = create_agent("inproc", "x", fabric=fabric)
    assert isinstance(agent, InprocAgent) and agent.fabric is fabric
    assert isinstance(create_agent("inproc", "factory-default"), InprocAgent)
    with pytest.raises(ConfigError):
        create_agent("carrier-pigeon", "y")
