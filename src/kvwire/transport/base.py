"""The Agent interface: NIXL's model, typed.

``Agent`` is what the connector, the handshake and the engines use; ``FullAgent`` adds what benches and
the conformance suite use (prepared lists, ``post`` of ``Desc`` lists). Both backends implement both:
``nixl`` (real NIXL, the default) and ``inproc`` (agents in one process that really copy bytes, with fault
injection); ``kvwire.transport.registry`` finds them by name, and ``kvwire.testing.conformance`` holds the
suite they both pass.

Vocabulary follows NIXL: an agent registers memory, publishes metadata, loads remote agents, prepares
descriptor lists and posts transfers between them. Two ways to load a peer:

* **notif-only**: load the peer from its connection-only metadata (``conn_metadata()``): notifications
  work, any transfer into or from its memory fails with ``NotAddressable``;
* **full**: load the peer from its full metadata (``metadata()``): its registered memory is addressable.
  Loading full metadata over a notif-only entry upgrades it in place.

Agent names carry the owner's incarnation (``make_agent_name``) because NIXL breaks an entry when a
restarted peer is re-added under the same name.
"""

from __future__ import annotations

import abc
import enum
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from kvwire.errors import (
    HandleReleased,
    NotAddressable,
    PeerNotFound,
    RegistrationError,
    TransferFailed,
    TransportError,
)

# Plain values every layer uses live in ``kvwire.protocol.types`` (importing them loads no I/O); they are
# re-exported here, where NIXL's vocabulary is.
from kvwire.protocol.types import Desc as Desc
from kvwire.protocol.types import MemKind as MemKind
from kvwire.protocol.types import PeerMode as PeerMode


class XferOp(enum.Enum):
    WRITE = "WRITE"
    READ = "READ"


class XferStatus(enum.Enum):
    IN_PROGRESS = "IN_PROGRESS"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class Registration:
    """A registered buffer. ``addr`` is the address of its first byte."""

    addr: int
    length: int
    kind: MemKind = MemKind.DRAM
    device_id: int = 0
    token: int = field(default=0, compare=False)


# Handles compare by identity: two transfers of the same shape are still different transfers.
@dataclass(eq=False, slots=True)
class DescListHandle:
    """A prepared descriptor list (local, or on one remote peer).

    ``epoch`` is the load of ``peer`` it was prepared against: a list prepared before the peer was removed
    (or re-added) is stale and refused, because NIXL requires remote lists to be prepared again.
    """

    peer: str | None
    descs: tuple[Desc, ...]
    raw: object = None
    released: bool = False
    kind: MemKind = MemKind.DRAM
    epoch: int = 0


@dataclass(eq=False, slots=True)
class XferHandle:
    """A posted transfer. Use ``Agent.status``; ``Agent.release`` when finished (idempotent)."""

    op: XferOp
    peer: str
    nbytes: int
    raw: object = None
    released: bool = False
    failed_reason: str | None = None
    # The last state seen; DONE and FAILED are final, so later polls answer from here.
    state: XferStatus = XferStatus.IN_PROGRESS


def make_agent_name(engine_id: str, incarnation: str, pp_rank: int, tp_rank: int) -> str:
    """An agent name unique per process life: a restarted peer gets a new name (NIXL #795)."""
    return f"{engine_id}/{incarnation}/pp{pp_rank}/tp{tp_rank}"


def new_incarnation() -> str:
    return secrets.token_hex(6)


DESC_DTYPE = np.dtype(np.int64)


def descs_to_array(descs: Sequence[Desc]) -> np.ndarray:
    """``[n, 3]`` int64 (addr, length, device id) rows of ``descs``: the form ``post_array`` takes."""
    out = np.empty((len(descs), 3), dtype=DESC_DTYPE)
    if descs:
        out[:] = [(d.addr, d.length, d.device_id) for d in descs]
    return out


def array_to_descs(array: np.ndarray) -> list[Desc]:
    """The ``Desc`` of each row of an ``[n, 3]`` descriptor array."""
    return [Desc(a, n, d) for a, n, d in array.tolist()]


def check_desc_arrays(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate a ``post_array`` pair; return both as C-contiguous int64 ``[n, 3]`` arrays (no copy when
    they already are). Raises ``TransferFailed`` for bad shapes, no rows, non-positive lengths,
    negative addresses or device ids, or rows whose lengths differ between the two sides."""
    out = []
    for side, arr in (("local", local), ("remote", remote)):
        if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.shape[1] != 3:
            shape = getattr(arr, "shape", type(arr).__name__)
            raise TransferFailed(f"{side} descriptors must be an [n, 3] array, not {shape}")
        if arr.dtype.kind not in "iu":
            raise TransferFailed(f"{side} descriptors must be integers, got {arr.dtype}")
        out.append(np.ascontiguousarray(arr, dtype=DESC_DTYPE))
    lo, re = out
    if lo.shape[0] != re.shape[0]:
        raise TransferFailed(f"{lo.shape[0]} local descriptors but {re.shape[0]} remote ones")
    if lo.shape[0] == 0:
        raise TransferFailed("a transfer needs at least one descriptor")
    for side, arr in (("local", lo), ("remote", re)):
        # Column by column: numpy's axis-0 reduction of an [n, 3] array is several times slower.
        if int(arr[:, 0].min()) < 0 or int(arr[:, 1].min()) <= 0 or int(arr[:, 2].min()) < 0:
            raise TransferFailed(f"{side} descriptors need positive lengths and non-negative addresses")
    if not np.array_equal(lo[:, 1], re[:, 1]):
        i = int(np.flatnonzero(lo[:, 1] != re[:, 1])[0])
        raise TransferFailed(f"length mismatch at index {i}: {int(lo[i, 1])} != {int(re[i, 1])}")
    return lo, re


def array_desc(array: np.ndarray) -> Desc:
    """The byte range of a C-contiguous array."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous to be registered or transferred")
    return Desc(int(array.ctypes.data), int(array.nbytes), 0)


class Agent(abc.ABC):
    """One transfer agent (one per engine rank): what the connector, the handshake and the engines use.

    This is the whole interface a transport must implement to carry kvwire's protocol (12 abstract
    methods; ``docs/architecture.md``'s recipe). The prepared-list calls, ``post`` of ``Desc`` lists and
    ``peer_mode`` that benches and the conformance suite also use are ``FullAgent``'s, below.
    """

    name: str

    # -- memory --------------------------------------------------------------------------------------
    def register(self, array: np.ndarray, kind: MemKind = MemKind.DRAM) -> Registration:
        """Register a C-contiguous numpy array (kept alive while registered)."""
        try:
            desc = array_desc(array)
        except ValueError as exc:
            raise RegistrationError(str(exc)) from exc
        return self.register_range(desc.addr, desc.length, kind, desc.device_id, owner=array)

    @abc.abstractmethod
    def register_range(
        self,
        addr: int,
        length: int,
        kind: MemKind = MemKind.DRAM,
        device_id: int = 0,
        *,
        owner: object = None,
    ) -> Registration:
        """Register memory this process owns but kvwire did not allocate (an engine's KV tensors);
        ``owner`` is kept referenced while registered."""

    @abc.abstractmethod
    def deregister(self, reg: Registration) -> None: ...

    # -- metadata and peers --------------------------------------------------------------------------
    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Full metadata: connection info and every registered region."""

    @abc.abstractmethod
    def conn_metadata(self) -> bytes:
        """Connection-only metadata: enough to load this agent notif-only."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent from its (full or connection-only) metadata; returns its agent name."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Unload a remote agent; transfers and notifications to it then fail with ``PeerNotFound``."""

    async def load_peer(self, metadata: bytes, timeout_s: float) -> str:
        """``add_peer`` for callers on an event loop, bounded by ``timeout_s``.

        A backend whose load can wait on the network (NIXL: UCX connects while loading) runs it where it
        cannot stall the caller's loop and raises ``AgentStalled`` past ``timeout_s``; this default, for
        backends whose load never waits, loads inline."""
        return self.add_peer(metadata)

    def warm_up(self) -> None:
        """Pay now a one-off cost the first peer load would otherwise pay inside the first request's
        handshake (NIXL: UCX's first endpoint). Raises ``TransportError`` on failure (the caller logs it
        and goes on); this default, for backends with no such cost, does nothing."""
        return None

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds a call on this agent has been stuck past its deadline (0.0 when none is): an engine
        whose agent is held this way cannot move KV, and its ``/health`` should say so."""
        return 0.0

    @property
    def stuck_calls(self) -> int:
        """Calls on this agent that overran their deadline since it was created."""
        return 0

    # -- transfers -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def post_array(
        self,
        op: XferOp,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes | None = None,
        kind: MemKind = MemKind.DRAM,
    ) -> XferHandle:
        """Post a transfer between two ``[n, 3]`` integer arrays of (addr, length, device id) rows;
        ``notif`` arrives after the data.

        The connector's one way to move KV (``TransferPlan.src_array``): backends hand the arrays to the
        engine without a Python loop per descriptor. Rows are validated as a whole (``check_desc_arrays``:
        ``TransferFailed`` on bad shapes or unequal lengths). Failing to post raises (``PeerNotFound``,
        ``NotAddressable``, ``PeerDisconnected``, ``TransferFailed``); a failure after posting shows as
        ``XferStatus.FAILED``.
        """

    @abc.abstractmethod
    def status(self, handle: XferHandle) -> XferStatus:
        """Poll a transfer; an exception from the engine means FAILED (NIXL raises on a dead peer)."""

    @abc.abstractmethod
    def release(self, handle: XferHandle) -> None:
        """Release a transfer handle; idempotent. A released handle cannot be polled again."""

    # -- notifications -------------------------------------------------------------------------------
    @abc.abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None: ...

    @abc.abstractmethod
    def drain_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, per sending agent, in arrival order."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent. Any later call raises ``AgentClosed``."""

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullAgent(Agent):
    """The extension benches, the demo's transport tour and the conformance suite use on top of ``Agent``:
    NIXL's prepared descriptor lists, ``post`` of ``Desc`` lists, ``peer_mode``, explicit ``progress``.
    The connector uses none of it; both built-in backends implement it."""

    @abc.abstractmethod
    def peer_mode(self, peer: str) -> PeerMode | None:
        """How ``peer`` is loaded here, or None when it is not."""

    @abc.abstractmethod
    def prep_local(self, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        """Prepare local descriptors (each inside one registration) to be used by index."""

    @abc.abstractmethod
    def prep_remote(self, peer: str, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        """Prepare descriptors of a full peer's registered memory; ``NotAddressable`` otherwise."""

    @abc.abstractmethod
    def release_dlist(self, handle: DescListHandle) -> None:
        """Idempotent."""

    @abc.abstractmethod
    def post_prepped(
        self,
        op: XferOp,
        local: DescListHandle,
        local_idx: Sequence[int],
        remote: DescListHandle,
        remote_idx: Sequence[int],
        notif: bytes | None = None,
    ) -> XferHandle:
        """Post a transfer between entries of two prepared lists; ``notif`` arrives after the data."""

    @abc.abstractmethod
    def post(
        self,
        op: XferOp,
        local: Sequence[Desc],
        remote: Sequence[Desc],
        peer: str,
        notif: bytes | None = None,
        kind: MemKind = MemKind.DRAM,
    ) -> XferHandle:
        """Post a transfer between two equally long lists of descriptors (no preparation needed).

        Pairs must have equal lengths. Failing to post raises (``PeerNotFound``, ``NotAddressable``,
        ``PeerDisconnected``, ``TransferFailed``); a failure after posting shows as ``XferStatus.FAILED``.
        """

    def post_array(
        self,
        op: XferOp,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes | None = None,
        kind: MemKind = MemKind.DRAM,
    ) -> XferHandle:
        """``Agent.post_array`` by way of ``post``: this default converts the rows to ``Desc`` lists."""
        lo, re = check_desc_arrays(local, remote)
        return self.post(op, array_to_descs(lo), array_to_descs(re), peer, notif, kind)

    @abc.abstractmethod
    def progress(self) -> None:
        """Make progress on pending work; the owner's loop calls this (no progress thread)."""


def as_full(agent: Agent) -> FullAgent:
    """``agent`` as a ``FullAgent`` (for test kits and benches that reach past the connector's interface);
    ``TransportError`` when its transport implements only ``Agent``."""
    if not isinstance(agent, FullAgent):
        raise TransportError(f"agent {agent.name} ({type(agent).__name__}) has no prepared lists or post()")
    return agent


@dataclass(slots=True)
class PeerEntry:
    """A loaded remote agent: how it is loaded, and which load of it (``DescListHandle.epoch``)."""

    mode: PeerMode
    epoch: int


PeerT = TypeVar("PeerT", bound=PeerEntry)


class PeerTableAgent(FullAgent, Generic[PeerT]):
    """The checks both backends share: a table of loaded peers and the refusals every call makes."""

    _peers: dict[str, PeerT]
    _inbox: dict[str, list[bytes]]

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise ``AgentClosed`` once the agent may no longer be used."""

    def _check_range(self, addr: int, length: int) -> None:
        """Refuse, on a closed agent or for an empty or null range, what ``register_range`` would register."""
        self._check_open()
        if addr <= 0 or length <= 0:
            raise RegistrationError(f"cannot register [{addr:#x}, +{length})")

    def _forget_peer(self, peer: str) -> None:
        self._check_open()
        if self._peers.pop(peer, None) is None:
            raise PeerNotFound(f"peer {peer} is not loaded")

    def peer_mode(self, peer: str) -> PeerMode | None:
        entry = self._peers.get(peer)
        return None if entry is None else entry.mode

    def _full_peer(self, peer: str) -> PeerT:
        entry = self._peers.get(peer)
        if entry is None:
            raise PeerNotFound(f"peer {peer} is not loaded")
        if entry.mode is not PeerMode.FULL:
            raise NotAddressable(f"peer {peer} is loaded notif-only: its memory is not addressable")
        return entry

    def _prepped_peer(self, local: DescListHandle, remote: DescListHandle) -> tuple[str, PeerT]:
        """``post_prepped``'s refusals; the remote peer's name and entry when the two lists may be used."""
        self._check_open()
        if local.released or remote.released:
            raise HandleReleased("descriptor list used after release")
        if local.peer is not None or remote.peer is None:
            raise TransferFailed("post_prepped takes a local list and a remote list, in that order")
        entry = self._full_peer(remote.peer)
        if remote.epoch != entry.epoch:
            raise PeerNotFound(f"remote list was prepared for an earlier load of {remote.peer}")
        return remote.peer, entry

    def _check_pollable(self, handle: XferHandle) -> None:
        if handle.released:
            raise HandleReleased(f"{handle.op.value} to {handle.peer} was released")
        self._check_open()

    def _check_notif_peer(self, peer: str) -> None:
        self._check_open()
        if peer not in self._peers:
            raise PeerNotFound(f"peer {peer} is not loaded")

    def drain_notifs(self) -> dict[str, list[bytes]]:
        self.progress()
        out, self._inbox = self._inbox, {}
        return out
