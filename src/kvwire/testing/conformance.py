"""The transport conformance suite: the checks every backend of ``kvwire.transport`` must pass.

A backend plugs in the way a stream does in trio's ``testing.check_*_stream``: by a *backend maker*, a
function with no arguments that returns a fresh ``AgentFactory`` (``name -> Agent``). Every check calls
the maker once and builds its two agents from what it returned, so agents of one call must reach each
other and agents of different calls need not (an in-process backend makes a new fabric per call)::

    from kvwire.testing.conformance import check_backend
    check_backend(lambda: MyFabric().create_agent)  # raises on the first check that fails

or one test per check, so a report names the check that failed::

    @pytest.mark.parametrize("name", CHECKS)
    def test_my_backend(name: str) -> None:
        run_check(name, lambda: MyFabric().create_agent)

``BUILTIN_BACKENDS`` holds the makers of the registered transports (``inproc`` and ``nixl``; both agents
in this one process, which NIXL supports). A check is ``check(a, b)``: ``a`` initiates (P-like), ``b`` is
the remote (D-like); it fails by raising ``AssertionError``. Waits are bounded loops
that fail with a message, never assertions on time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from kvwire.errors import (
    AgentClosed,
    HandleReleased,
    NotAddressable,
    PeerNotFound,
    RegistrationError,
    TransferFailed,
    TransportError,
)
from kvwire.testing.buffer_peer import pattern
from kvwire.transport import registry
from kvwire.transport.base import (
    Desc,
    FullAgent,
    PeerMode,
    XferHandle,
    XferOp,
    XferStatus,
    array_desc,
    descs_to_array,
    make_agent_name,
    new_incarnation,
)
from kvwire.transport.registry import FullAgentFactory

BackendMaker = Callable[[], FullAgentFactory]
Check = Callable[[FullAgent, FullAgent], None]

WAIT_S = 10.0
BLOCK = 4096


@contextmanager
def raises(expected: type[BaseException]) -> Iterator[None]:
    """The block must raise ``expected`` (a subclass counts); ``AssertionError`` otherwise. The suite's own
    ``pytest.raises``: the test kit runs without pytest (an out-of-tree backend's own runner may call it)."""
    try:
        yield
    except expected:
        return
    raise AssertionError(f"expected {expected.__name__}, nothing was raised")


def _maker(name: str) -> BackendMaker:
    # Looked up on use: the inproc checks must run where NIXL is not installed.
    return lambda: registry.lookup(name).conformance_factory()


# Every registered transport's maker (``kvwire.transport.registry``): a transport added there is checked.
BUILTIN_BACKENDS: dict[str, BackendMaker] = {name: _maker(name) for name in registry.BUILTIN}


def run_check(check: str | Check, make_backend: BackendMaker) -> None:
    """Run one check (by name in ``CHECKS``, or the function) on two fresh agents, closed afterwards."""
    fn = CHECKS[check] if isinstance(check, str) else check
    make_agent = make_backend()
    incarnation = new_incarnation()
    a = make_agent(make_agent_name("conf-a", incarnation, 0, 0))
    try:
        b = make_agent(make_agent_name("conf-b", incarnation, 0, 0))
        try:
            fn(a, b)
        finally:
            b.close()
    finally:
        a.close()


def check_backend(make_backend: BackendMaker, *, skip: Iterable[str] = ()) -> None:
    """Run every check in ``CHECKS`` but those named in ``skip``; the first failure propagates."""
    skipped = set(skip)
    unknown = skipped - CHECKS.keys()
    if unknown:
        raise ValueError(f"no such conformance checks: {sorted(unknown)}")
    for name, fn in CHECKS.items():
        if name not in skipped:
            run_check(fn, make_backend)


def wait_done(agent: FullAgent, handle: XferHandle, *others: FullAgent) -> XferStatus:
    """Poll until the transfer leaves IN_PROGRESS (bounded); ``others`` are progressed meanwhile."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        state = agent.status(handle)
        if state is not XferStatus.IN_PROGRESS:
            return state
        for other in others:
            other.progress()
        time.sleep(0.0005)
    raise AssertionError(f"transfer still in progress after {WAIT_S} s")


def wait_notifs(receiver: FullAgent, sender: FullAgent, count: int) -> list[bytes]:
    """Collect ``count`` notifications from ``sender`` at ``receiver`` (bounded), progressing both."""
    got: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        sender.progress()
        got.extend(receiver.drain_notifs().get(sender.name, []))
        if len(got) < count:
            time.sleep(0.0005)
    assert len(got) >= count, f"got {len(got)} of {count} notifications"
    return got


def blocks(array: np.ndarray, block: int = BLOCK) -> list[Desc]:
    base = array_desc(array)
    return [Desc(base.addr + i * block, block) for i in range(base.length // block)]


def connect_full(a: FullAgent, b: FullAgent) -> None:
    assert a.add_peer(b.metadata()) == b.name


def check_registration(a: FullAgent, b: FullAgent) -> None:
    buf = np.zeros(8 * BLOCK, dtype=np.uint8)
    reg = a.register(buf)
    assert (reg.addr, reg.length) == (buf.ctypes.data, buf.nbytes)
    with raises(RegistrationError):
        a.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])  # not contiguous
    # Memory outside a registration cannot be transferred, locally or remotely.
    dst = np.zeros(8 * BLOCK, dtype=np.uint8)
    b.register(dst)
    connect_full(a, b)
    inside, outside = Desc(dst.ctypes.data, BLOCK), Desc(dst.ctypes.data + 7 * BLOCK + 1, BLOCK)
    with raises(NotAddressable):
        a.post(XferOp.WRITE, [Desc(buf.ctypes.data, BLOCK)], [outside], b.name)
    stray = np.zeros(BLOCK, dtype=np.uint8)
    with raises(NotAddressable):
        a.post(XferOp.WRITE, [array_desc(stray)], [inside], b.name)
    a.deregister(reg)
    with raises(RegistrationError):
        a.deregister(reg)


def check_metadata_round_trip(a: FullAgent, b: FullAgent) -> None:
    b.register(np.zeros(BLOCK, dtype=np.uint8))
    full, conn = b.metadata(), b.conn_metadata()
    assert isinstance(full, bytes) and isinstance(conn, bytes) and full and conn
    assert a.peer_mode(b.name) is None
    assert a.add_peer(full) == b.name
    assert a.peer_mode(b.name) is PeerMode.FULL
    assert a.add_peer(full) == b.name  # loading the same metadata again is harmless
    assert a.add_peer(conn) == b.name  # a full peer stays full for notif-only callers
    assert a.peer_mode(b.name) is PeerMode.FULL
    assert b.add_peer(a.conn_metadata()) == a.name
    assert b.peer_mode(a.name) is PeerMode.NOTIF_ONLY
    with raises(TransportError):
        a.add_peer(b"not metadata at all")


def check_notif_only_peer(a: FullAgent, b: FullAgent) -> None:
    src, dst = pattern(BLOCK, 1), np.zeros(BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    assert a.add_peer(b.conn_metadata()) == b.name
    assert a.peer_mode(b.name) is PeerMode.NOTIF_ONLY
    a.send_notif(b.name, b"hello")
    assert wait_notifs(b, a, 1) == [b"hello"]
    with raises(NotAddressable):
        a.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], b.name)
    with raises(NotAddressable):
        a.prep_remote(b.name, [array_desc(dst)])
    assert not dst.any()
    # Loading the full metadata upgrades the entry in place.
    a.add_peer(b.metadata())
    assert a.peer_mode(b.name) is PeerMode.FULL
    handle = a.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], b.name)
    assert wait_done(a, handle, b) is XferStatus.DONE
    a.release(handle)
    assert np.array_equal(dst, src)


def check_full_peer_write_read(a: FullAgent, b: FullAgent) -> None:
    nbytes = 1 << 20
    src, remote = pattern(nbytes, 2), pattern(nbytes, 3)
    expected_remote = remote.copy()
    a.register(src)
    b.register(remote)
    connect_full(a, b)
    # READ first: pulls b's bytes into a.
    read = a.post(XferOp.READ, [array_desc(src)], [array_desc(remote)], b.name)
    assert read.nbytes == nbytes
    assert wait_done(a, read, b) is XferStatus.DONE
    assert np.array_equal(src, expected_remote)
    a.release(read)
    # WRITE through prepared lists: b receives a's new bytes.
    src[:] = pattern(nbytes, 4)
    local, far = a.prep_local(blocks(src)), a.prep_remote(b.name, blocks(remote))
    n = nbytes // BLOCK
    write = a.post_prepped(XferOp.WRITE, local, range(n), far, range(n))
    assert wait_done(a, write, b) is XferStatus.DONE
    assert np.array_equal(remote, src)
    a.release(write)
    a.release_dlist(local)
    a.release_dlist(far)


def check_scattered_indices(a: FullAgent, b: FullAgent) -> None:
    n_src, n_dst, n = 64, 128, 48
    src, dst = pattern(n_src * BLOCK, 5), np.zeros(n_dst * BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    rng = np.random.default_rng(6)
    src_idx = rng.choice(n_src, size=n, replace=False)
    dst_idx = rng.choice(n_dst, size=n, replace=False)
    local, far = a.prep_local(blocks(src)), a.prep_remote(b.name, blocks(dst))
    handle = a.post_prepped(XferOp.WRITE, local, src_idx.tolist(), far, dst_idx.tolist())
    assert handle.nbytes == n * BLOCK
    assert wait_done(a, handle, b) is XferStatus.DONE
    got, want = dst.reshape(n_dst, BLOCK), src.reshape(n_src, BLOCK)
    assert np.array_equal(got[dst_idx], want[src_idx])
    untouched = np.setdiff1d(np.arange(n_dst), dst_idx)
    assert not got[untouched].any()
    # The same with unprepared descriptor lists.
    dst[:] = 0
    handle2 = a.post(
        XferOp.WRITE, [blocks(src)[i] for i in src_idx], [blocks(dst)[i] for i in dst_idx], b.name
    )
    assert wait_done(a, handle2, b) is XferStatus.DONE
    assert np.array_equal(got[dst_idx], want[src_idx])
    assert not got[untouched].any()
    for h in (handle, handle2):
        a.release(h)


def check_attached_notif_after_data(a: FullAgent, b: FullAgent) -> None:
    nbytes = 8 << 20
    src, dst = pattern(nbytes, 7), np.zeros(nbytes, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    b.add_peer(a.conn_metadata())
    handle = a.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], b.name, notif=b"xfer-1 done")
    # Look at the bytes the moment the notification shows up, before the initiator's status says DONE.
    deadline = time.monotonic() + WAIT_S
    got: list[bytes] = []
    while not got and time.monotonic() < deadline:
        a.progress()
        got = b.drain_notifs().get(a.name, [])
    assert got == [b"xfer-1 done"]
    assert np.array_equal(dst, src)
    assert wait_done(a, handle) is XferStatus.DONE
    a.release(handle)


def check_remove_then_transfer_fails(a: FullAgent, b: FullAgent) -> None:
    src, dst = pattern(BLOCK, 8), np.zeros(BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    far = a.prep_remote(b.name, [array_desc(dst)])
    local = a.prep_local([array_desc(src)])
    a.remove_peer(b.name)
    assert a.peer_mode(b.name) is None
    with raises(PeerNotFound):
        a.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], b.name)
    with raises(PeerNotFound):
        a.post_prepped(XferOp.WRITE, local, [0], far, [0])
    with raises(PeerNotFound):
        a.send_notif(b.name, b"anyone?")
    with raises(PeerNotFound):
        a.remove_peer(b.name)
    # A list prepared before the removal stays refused after the peer is loaded again.
    connect_full(a, b)
    with raises(PeerNotFound):
        a.post_prepped(XferOp.WRITE, local, [0], far, [0])
    a.release_dlist(far)
    fresh = a.prep_remote(b.name, [array_desc(dst)])
    handle = a.post_prepped(XferOp.WRITE, local, [0], fresh, [0])
    assert wait_done(a, handle, b) is XferStatus.DONE
    assert np.array_equal(dst, src)
    a.release(handle)
    assert not dst.any() or np.array_equal(dst, src)


def check_double_release(a: FullAgent, b: FullAgent) -> None:
    src, dst = pattern(BLOCK, 9), np.zeros(BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    local, far = a.prep_local([array_desc(src)]), a.prep_remote(b.name, [array_desc(dst)])
    handle = a.post_prepped(XferOp.WRITE, local, [0], far, [0])
    assert wait_done(a, handle, b) is XferStatus.DONE
    a.release(handle)
    a.release(handle)
    with raises(HandleReleased):
        a.status(handle)
    a.release_dlist(far)
    a.release_dlist(far)
    with raises(HandleReleased):
        a.post_prepped(XferOp.WRITE, local, [0], far, [0])
    a.release_dlist(local)


def check_close_idempotent(a: FullAgent, b: FullAgent) -> None:
    src, dst = pattern(BLOCK, 10), np.zeros(BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    handle = a.post(XferOp.WRITE, [array_desc(src)], [array_desc(dst)], b.name)
    wait_done(a, handle, b)
    a.close()
    a.close()
    a.release(handle)  # still safe after close
    with raises(AgentClosed):
        a.send_notif(b.name, b"x")
    with raises(AgentClosed):
        a.register(np.zeros(BLOCK, dtype=np.uint8))
    with raises(AgentClosed):
        a.metadata()


def block_rows(array: np.ndarray, idx: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """``[n, 3]`` int64 descriptor rows of blocks ``idx`` of ``array`` (built without a Python loop)."""
    rows = np.zeros((idx.size, 3), dtype=np.int64)
    rows[:, 0] = array.ctypes.data + idx.astype(np.int64) * block
    rows[:, 1] = block
    return rows


def check_post_array(a: FullAgent, b: FullAgent) -> None:
    n_src, n_dst, n = 64, 128, 40
    src, dst = pattern(n_src * BLOCK, 11), np.zeros(n_dst * BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    connect_full(a, b)
    b.add_peer(a.conn_metadata())
    rng = np.random.default_rng(12)
    src_idx = rng.choice(n_src, size=n, replace=False)
    dst_idx = rng.choice(n_dst, size=n, replace=False)
    local, remote = block_rows(src, src_idx), block_rows(dst, dst_idx)
    handle = a.post_array(XferOp.WRITE, local, remote, b.name, notif=b"rows done")
    local[:] = 0  # the descriptors were taken at post time: the caller may reuse its arrays
    remote[:] = 0
    assert handle.nbytes == n * BLOCK
    assert wait_notifs(b, a, 1) == [b"rows done"]
    assert wait_done(a, handle, b) is XferStatus.DONE
    a.release(handle)
    got, want = dst.reshape(n_dst, BLOCK), src.reshape(n_src, BLOCK)
    assert np.array_equal(got[dst_idx], want[src_idx])
    untouched = np.setdiff1d(np.arange(n_dst), dst_idx)
    assert not got[untouched].any()
    # READ back into a's zeroed blocks, with uint64 rows and through the interface's default (Desc) path.
    src[:] = 0
    rows_l = block_rows(src, src_idx).astype(np.uint64)
    rows_r = block_rows(dst, dst_idx).astype(np.uint64)
    read = FullAgent.post_array(a, XferOp.READ, rows_l, rows_r, b.name)
    assert wait_done(a, read, b) is XferStatus.DONE
    a.release(read)
    assert np.array_equal(want[src_idx], got[dst_idx])
    assert not np.delete(want, src_idx, axis=0).any()
    # The array and Desc forms describe the same transfer.
    assert np.array_equal(descs_to_array(blocks(src)), block_rows(src, np.arange(n_src)))


def check_post_array_errors(a: FullAgent, b: FullAgent) -> None:
    src, dst = pattern(4 * BLOCK, 13), np.zeros(8 * BLOCK, dtype=np.uint8)
    a.register(src)
    b.register(dst)
    local, remote = block_rows(src, np.arange(4)), block_rows(dst, np.arange(4))
    with raises(PeerNotFound):
        a.post_array(XferOp.WRITE, local, remote, b.name)
    a.add_peer(b.conn_metadata())
    with raises(NotAddressable):
        a.post_array(XferOp.WRITE, local, remote, b.name)
    a.add_peer(b.metadata())
    bad_cases = [
        (local[:3], remote),  # unequal counts
        (local[:0], remote[:0]),  # nothing to move
        (local[:, :2], remote[:, :2]),  # not [n, 3]
        (local.astype(np.float64), remote),  # not integers
    ]
    short = remote.copy()
    short[2, 1] = BLOCK // 2
    bad_cases.append((local, short))  # a row's lengths differ
    negative = local.copy()
    negative[1, 1] = -BLOCK
    bad_cases.append((negative, remote))
    for lo, re in bad_cases:
        with raises(TransferFailed):
            a.post_array(XferOp.WRITE, lo, re, b.name)
    outside = remote.copy()
    outside[3, 0] = dst.ctypes.data + 8 * BLOCK - BLOCK // 2  # runs past the end of b's registration
    with raises(NotAddressable):
        a.post_array(XferOp.WRITE, local, outside, b.name)
    stray = np.zeros(BLOCK, dtype=np.uint8)
    with raises(NotAddressable):
        a.post_array(XferOp.WRITE, block_rows(stray, np.arange(1)), remote[:1], b.name)
    assert not dst.any()


# Every check, by name (the order they run in): what a backend must do to be a kvwire transport.
CHECKS: dict[str, Check] = {
    "registration": check_registration,
    "metadata_round_trip": check_metadata_round_trip,
    "notif_only_peer": check_notif_only_peer,
    "full_peer_write_read": check_full_peer_write_read,
    "scattered_indices": check_scattered_indices,
    "attached_notif_after_data": check_attached_notif_after_data,
    "remove_then_transfer_fails": check_remove_then_transfer_fails,
    "double_release": check_double_release,
    "close_idempotent": check_close_idempotent,
    "post_array": check_post_array,
    "post_array_errors": check_post_array_errors,
}
