"""The in-process backend: agents in one process that really copy bytes, with fault injection.

Agents are created by an ``InprocFabric`` (the stand-in for the network). A transfer copies bytes between
registered buffers with ``ctypes.memmove``, checked against the target's registered memory both when it is
posted (as loaded from the target's metadata, as NIXL does) and when it runs (against the target's live
registrations, so that a deregistered buffer is never written). An attached notification is delivered
only after its copy.

Faults (``InprocFaults``, per agent, applied to what that agent initiates): delay a transfer by a number
of the initiator's ``status``/``progress`` calls or by time, fail transfers, drop / duplicate / reorder
notifications, stall peer loads (``stall_loads_s``: each ``load_peer`` first blocks the agent's worker
thread that long, as NIXL's load does toward a peer whose UCX port drops packets; only the load is modelled,
not the other calls NIXL then holds up). ``InprocFabric.kill(name)`` kills an agent: transfers and
notifications to it then fail with ``PeerDisconnected``, transfers in flight to it end FAILED, and the dead
agent refuses every call.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.errors import (
    AgentClosed,
    NotAddressable,
    PeerDisconnected,
    PeerNotFound,
    RegistrationError,
    TransferFailed,
    TransportError,
)
from kvwire.transport.base import (
    Desc,
    DescListHandle,
    MemKind,
    PeerEntry,
    PeerMode,
    PeerTableAgent,
    Registration,
    XferHandle,
    XferOp,
    XferStatus,
    check_desc_arrays,
    descs_to_array,
)
from kvwire.transport.offload import CallWorker
from kvwire.transport.registry import AgentOptions, FullAgentFactory, Transport

_MD_TAG = "kvwire-inproc-v1"


@dataclass(slots=True)
class InprocFaults:
    """Faults applied to what one agent initiates. Counters count down as they fire."""

    delay_calls: int = 0  # a transfer completes only after this many status()/progress() calls
    delay_s: float = 0.0  # ... and not before this many seconds after it was posted
    fail_transfers: int = 0  # the next N transfers end FAILED without copying
    drop_notifs: int = 0  # the next N notifications (standalone or attached) vanish
    duplicate_notifs: int = 0  # the next N notifications are delivered twice
    reorder_notifs: int = 0  # the next N notifications are held, then delivered in reverse order
    drop_rate: float = 0.0  # probability that any notification vanishes
    duplicate_rate: float = 0.0  # probability that any notification is delivered twice
    stall_loads_s: float = 0.0  # each load_peer first blocks the agent's worker thread this long
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False)
    _held: list[tuple[InprocAgent, str, bytes]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)


@dataclass(slots=True)
class _Region:
    addr: int
    length: int
    kind: MemKind


@dataclass(slots=True)
class _Peer(PeerEntry):
    regions: list[_Region]


@dataclass(eq=False, slots=True)
class _Xfer:
    op: XferOp
    target: str
    local: np.ndarray  # [n, 3] int64 (addr, length, device id) rows
    remote: np.ndarray
    notif: bytes | None
    calls_left: int
    not_before: float
    fail: bool


class InprocFabric:
    """The registry that in-process agents reach each other through."""

    def __init__(self) -> None:
        self._agents: dict[str, InprocAgent] = {}
        self._dead: set[str] = set()

    def create_agent(self, name: str, faults: InprocFaults | None = None) -> InprocAgent:
        if name in self._agents and self._agents[name].alive:
            raise TransportError(f"an agent named {name} already lives on this fabric")
        agent = InprocAgent(self, name, faults)
        self._agents[name] = agent
        self._dead.discard(name)
        return agent

    def kill(self, name: str) -> None:
        """The agent's process dies: it stops answering and its memory is gone."""
        agent = self._agents.get(name)
        if agent is None:
            raise PeerNotFound(f"no agent {name} on this fabric")
        self._dead.add(name)
        agent._die()

    def lookup(self, name: str) -> InprocAgent:
        """The live agent named ``name``; ``PeerDisconnected`` if it died or closed."""
        agent = self._agents.get(name)
        if agent is None or name in self._dead or not agent.alive:
            raise PeerDisconnected(f"agent {name} is gone")
        return agent


def _check_pairs(local: Sequence[Desc], remote: Sequence[Desc]) -> None:
    if len(local) != len(remote) or not local:
        raise TransferFailed(f"{len(local)} local descriptors and {len(remote)} remote ones")
    for i, (a, b) in enumerate(zip(local, remote, strict=True)):
        if a.length != b.length:
            raise TransferFailed(f"length mismatch at index {i}: {a.length} != {b.length}")


def _first_uncovered(rows: np.ndarray, regions: Sequence[_Region]) -> int | None:
    """Index of the first ``[n, 3]`` row not inside one of ``regions``, or None (vectorized)."""
    if rows.shape[0] == 0:
        return None
    if not regions:
        return 0
    bounds = np.array([(r.addr, r.addr + r.length) for r in regions], dtype=np.int64)
    start = rows[:, 0:1]
    inside = (start >= bounds[:, 0]) & (start + rows[:, 1:2] <= bounds[:, 1])
    bad = np.flatnonzero(~inside.any(axis=1))
    return int(bad[0]) if bad.size else None


def _row_desc(rows: np.ndarray, i: int) -> Desc:
    a, n, d = rows[i].tolist()
    return Desc(a, n, d)


def _indices(idx: Sequence[int], size: int, side: str) -> list[int]:
    out = [int(i) for i in np.asarray(idx, dtype=np.int64).reshape(-1)]
    if any(i < 0 or i >= size for i in out):
        raise TransferFailed(f"{side} index out of range for a list of {size}")
    return out


class InprocAgent(PeerTableAgent[_Peer]):
    """One in-process agent; create it through ``InprocFabric.create_agent``."""

    def __init__(self, fabric: InprocFabric, name: str, faults: InprocFaults | None = None) -> None:
        self.name = name
        self.fabric = fabric
        self.faults = faults or InprocFaults()
        self._regs: dict[int, tuple[Registration, object]] = {}
        self._tokens = itertools.count(1)
        self._epochs = itertools.count(1)
        self._peers: dict[str, _Peer] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._pending: list[XferHandle] = []
        self._closed = False
        self._killed = False
        self._calls: CallWorker | None = None  # made on the first stalled load
        # Set to end every stalled load at once (tests: the "network" heals, or the test ends).
        self.unstall = threading.Event()

    @property
    def alive(self) -> bool:
        return not (self._closed or self._killed)

    def _check_open(self) -> None:
        if not self.alive:
            raise AgentClosed(f"agent {self.name} is {'dead' if self._killed else 'closed'}")

    def _die(self) -> None:
        self._killed = True
        self._regs.clear()
        self._pending.clear()
        self._inbox.clear()

    # -- memory --------------------------------------------------------------------------------------
    def register_range(
        self,
        addr: int,
        length: int,
        kind: MemKind = MemKind.DRAM,
        device_id: int = 0,
        *,
        owner: object = None,
    ) -> Registration:
        self._check_range(addr, length)
        reg = Registration(addr, length, kind, device_id, next(self._tokens))
        self._regs[reg.token] = (reg, owner)  # the reference keeps the memory alive while registered
        return reg

    def deregister(self, reg: Registration) -> None:
        self._check_open()
        if self._regs.pop(reg.token, None) is None:
            raise RegistrationError(f"not registered here: {reg}")

    def _local_regions(self) -> list[_Region]:
        return [_Region(r.addr, r.length, r.kind) for r, _ in self._regs.values()]

    def _uncovered(self, rows: np.ndarray, kind: MemKind | None) -> Desc | None:
        """The first ``[n, 3]`` row not inside one registration (of ``kind``, if given), or None."""
        regions = [r for r in self._local_regions() if kind is None or r.kind is kind]
        i = _first_uncovered(rows, regions)
        return None if i is None else _row_desc(rows, i)

    # -- metadata and peers --------------------------------------------------------------------------
    def _md(self, regions: list[_Region], mode: PeerMode) -> bytes:
        body = {
            "tag": _MD_TAG,
            "agent": self.name,
            "mode": mode.value,
            "regions": [[r.addr, r.length, r.kind.value] for r in regions],
        }
        return json.dumps(body).encode()

    def metadata(self) -> bytes:
        self._check_open()
        return self._md(self._local_regions(), PeerMode.FULL)

    def conn_metadata(self) -> bytes:
        self._check_open()
        return self._md([], PeerMode.NOTIF_ONLY)

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        try:
            body = json.loads(metadata)
            if body["tag"] != _MD_TAG:
                raise ValueError(body["tag"])
            name = str(body["agent"])
            mode = PeerMode(body["mode"])
            regions = [_Region(int(a), int(n), MemKind(k)) for a, n, k in body["regions"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"cannot load remote agent metadata: {exc}") from exc
        if name not in self.fabric._agents:
            raise PeerNotFound(f"no agent {name} on this fabric")
        current = self._peers.get(name)
        if current is None:
            self._peers[name] = _Peer(mode, next(self._epochs), regions)
        elif mode is PeerMode.FULL:
            current.mode = PeerMode.FULL
            current.regions = regions
        return name

    async def load_peer(self, metadata: bytes, timeout_s: float) -> str:
        stall = self.faults.stall_loads_s
        if stall <= 0 and self._calls is None:
            return self.add_peer(metadata)
        if self._calls is None:
            self._calls = CallWorker(self.name)
        # Only the wait runs in the worker, the load itself on the caller's thread once the wait is over:
        # the fabric is not shared with a second thread. Once made, the worker is always used, so that a
        # load stuck there refuses the next ones as NIXL's does.
        await self._calls.call(lambda: stall <= 0 or self.unstall.wait(stall), timeout_s, "add_remote_agent")
        return self.add_peer(metadata)

    def stalled_s(self, now: float | None = None) -> float:
        return 0.0 if self._calls is None else self._calls.stalled_s(now)

    @property
    def stuck_calls(self) -> int:
        return 0 if self._calls is None else self._calls.stuck_calls

    def remove_peer(self, peer: str) -> None:
        self._forget_peer(peer)

    def _check_remote(self, entry: _Peer, peer: str, rows: np.ndarray, kind: MemKind) -> None:
        i = _first_uncovered(rows, [r for r in entry.regions if r.kind is kind])
        if i is not None:
            raise NotAddressable(f"{_row_desc(rows, i)} is outside {peer}'s registered memory")

    def _check_local(self, rows: np.ndarray, kind: MemKind) -> None:
        bad = self._uncovered(rows, kind)
        if bad is not None:
            raise NotAddressable(f"{bad} is outside this agent's registered memory")

    # -- descriptor lists ----------------------------------------------------------------------------
    def prep_local(self, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        self._check_open()
        self._check_local(descs_to_array(descs), kind)
        return DescListHandle(None, tuple(descs), kind=kind)

    def prep_remote(self, peer: str, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        self._check_open()
        entry = self._full_peer(peer)
        self._check_remote(entry, peer, descs_to_array(descs), kind)
        return DescListHandle(peer, tuple(descs), kind=kind, epoch=entry.epoch)

    def release_dlist(self, handle: DescListHandle) -> None:
        handle.released = True

    # -- transfers -----------------------------------------------------------------------------------
    def post_prepped(
        self,
        op: XferOp,
        local: DescListHandle,
        local_idx: Sequence[int],
        remote: DescListHandle,
        remote_idx: Sequence[int],
        notif: bytes | None = None,
    ) -> XferHandle:
        peer, _ = self._prepped_peer(local, remote)
        lidx = _indices(local_idx, len(local.descs), "local")
        ridx = _indices(remote_idx, len(remote.descs), "remote")
        ldescs = [local.descs[i] for i in lidx]
        rdescs = [remote.descs[i] for i in ridx]
        lrows, rrows = descs_to_array(ldescs), descs_to_array(rdescs)
        # Local memory may have been deregistered since the list was prepared.
        self._check_local(lrows, local.kind)
        _check_pairs(ldescs, rdescs)
        return self._post(op, lrows, rrows, peer, notif)

    def post(
        self,
        op: XferOp,
        local: Sequence[Desc],
        remote: Sequence[Desc],
        peer: str,
        notif: bytes | None = None,
        kind: MemKind = MemKind.DRAM,
    ) -> XferHandle:
        self._check_open()
        entry = self._full_peer(peer)
        lrows, rrows = descs_to_array(local), descs_to_array(remote)
        self._check_local(lrows, kind)
        self._check_remote(entry, peer, rrows, kind)
        _check_pairs(local, remote)
        return self._post(op, lrows, rrows, peer, notif)

    def post_array(
        self,
        op: XferOp,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes | None = None,
        kind: MemKind = MemKind.DRAM,
    ) -> XferHandle:
        self._check_open()
        entry = self._full_peer(peer)
        lrows, rrows = check_desc_arrays(local, remote)
        self._check_local(lrows, kind)
        self._check_remote(entry, peer, rrows, kind)
        # Copied: the caller may reuse its arrays while the transfer is pending.
        return self._post(op, lrows.copy(), rrows.copy(), peer, notif)

    def _post(
        self, op: XferOp, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes | None
    ) -> XferHandle:
        self.fabric.lookup(peer)  # like NIXL: posting towards a dead peer raises at once
        fail = self.faults.fail_transfers > 0
        if fail:
            self.faults.fail_transfers -= 1
        xfer = _Xfer(
            op,
            peer,
            local,
            remote,
            notif,
            self.faults.delay_calls,
            time.monotonic() + self.faults.delay_s,
            fail,
        )
        handle = XferHandle(op, peer, int(local[:, 1].sum()), xfer)
        self._pending.append(handle)
        self._advance(handle, count_call=False)
        return handle

    def _advance(self, handle: XferHandle, count_call: bool = True) -> None:
        xfer = handle.raw
        assert isinstance(xfer, _Xfer)
        if handle.state is not XferStatus.IN_PROGRESS:
            return
        try:
            target = self.fabric.lookup(xfer.target)
        except PeerDisconnected as exc:
            self._finish(handle, XferStatus.FAILED, str(exc))
            return
        if count_call and xfer.calls_left > 0:
            xfer.calls_left -= 1
        if xfer.calls_left > 0 or time.monotonic() < xfer.not_before:
            return
        if xfer.fail:
            self._finish(handle, XferStatus.FAILED, "injected failure")
            return
        # Checked again now: a buffer deregistered since posting may be freed, and must not be touched.
        if self._uncovered(xfer.local, None) is not None:
            self._finish(handle, XferStatus.FAILED, "local memory was deregistered")
            return
        if target._uncovered(xfer.remote, None) is not None:
            self._finish(handle, XferStatus.FAILED, f"{xfer.target} deregistered the target memory")
            return
        dst, src = (xfer.remote, xfer.local) if xfer.op is XferOp.WRITE else (xfer.local, xfer.remote)
        for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), src[:, 1].tolist(), strict=True):
            ctypes.memmove(d, s, n)
        self._finish(handle, XferStatus.DONE, None)
        if xfer.notif is not None:
            self._emit(target, xfer.notif)

    def _finish(self, handle: XferHandle, state: XferStatus, reason: str | None) -> None:
        handle.state = state
        handle.failed_reason = reason
        if handle in self._pending:
            self._pending.remove(handle)

    def status(self, handle: XferHandle) -> XferStatus:
        self._check_pollable(handle)
        self._advance(handle)
        return handle.state

    def release(self, handle: XferHandle) -> None:
        # Releasing an in-flight transfer cancels it: no copy, no notification (as in NIXL).
        handle.released = True
        if handle in self._pending:
            self._pending.remove(handle)

    # -- notifications -------------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        self._check_notif_peer(peer)
        self._emit(self.fabric.lookup(peer), msg)

    def _emit(self, target: InprocAgent, msg: bytes) -> None:
        f = self.faults
        if f.reorder_notifs > 0:
            f._held.append((target, self.name, msg))
            f.reorder_notifs -= 1
            if f.reorder_notifs == 0:
                held, f._held = f._held, []
                for tgt, sender, m in reversed(held):
                    if tgt.alive:
                        tgt._receive(sender, m)
            return
        if f.drop_notifs > 0:
            f.drop_notifs -= 1
            return
        if f.drop_rate and f._rng.random() < f.drop_rate:
            return
        copies = 1
        if f.duplicate_notifs > 0:
            f.duplicate_notifs -= 1
            copies = 2
        elif f.duplicate_rate and f._rng.random() < f.duplicate_rate:
            copies = 2
        for _ in range(copies):
            target._receive(self.name, msg)

    def _receive(self, sender: str, msg: bytes) -> None:
        self._inbox.setdefault(sender, []).append(bytes(msg))

    def progress(self) -> None:
        self._check_open()
        for handle in list(self._pending):
            self._advance(handle)

    # -- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.unstall.set()  # a stalled load's thread ends with the agent
        if self._calls is not None:
            self._calls.close()
        self._pending.clear()
        self._peers.clear()
        self._regs.clear()


_default_fabric: InprocFabric | None = None
_default_lock = threading.Lock()


def default_fabric() -> InprocFabric:
    """The process-wide fabric ``create_agent("inproc", ...)`` joins when given none."""
    global _default_fabric
    with _default_lock:
        if _default_fabric is None:
            _default_fabric = InprocFabric()
        return _default_fabric


def _create(name: str, options: AgentOptions) -> InprocAgent:
    return (options.fabric or default_fabric()).create_agent(name, options.faults)


def _fresh_factory() -> FullAgentFactory:
    return InprocFabric().create_agent


TRANSPORT = Transport(name="inproc", create=_create, conformance_factory=_fresh_factory)
