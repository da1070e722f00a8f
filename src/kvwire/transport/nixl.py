"""The real NIXL backend: ``kvwire.transport.base.Agent`` over ``nixl._api.nixl_agent``.

NIXL's exceptions are translated here and nowhere else. Three facts shape this module
(see shared/reference/nixl-faults.md):

* NIXL *raises* on a dead peer (``transfer``, ``check_xfer_state``, ``send_notif``) rather than returning
  "ERR"; both mean FAILED.
* With the progress thread off, notifications (attached or not) leave only when the owner makes a progress
  call, so ``progress()`` pulls notifications into a local inbox that ``drain_notifs()`` empties.
* A released NIXL handle answers meaningless states, so released handles are refused here.
* Loading a peer can block for minutes inside UCX's connect (an unreachable UCX port) while holding the
  UCX worker's lock: ``load_peer`` runs it in the agent's worker thread with a deadline, and every other
  call takes the agent's lock through ``kvwire.transport.offload.CallWorker`` (bounded waits; progress and
  polls are skipped, releases deferred, while a load is stuck). Metadata is cached so that the side
  channel answers even then.

Metadata is wrapped in a 6-byte header saying whether it is full or connection-only, because NIXL's own
blob does not tell a loader which one it got, and the peer mode must be known before any transfer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from kvwire.errors import (
    AgentBusy,
    AgentClosed,
    ConfigError,
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
)
from kvwire.transport.offload import DEFAULT_GRACE_S, CallWorker
from kvwire.transport.registry import AgentOptions, FullAgentFactory, Transport
from kvwire.transport.ucx_env import DEFAULT_CONNECT_TIMEOUT_S, apply_ucx_defaults, has_infiniband

_MAGIC = b"KVWN\x01"
_FULL = b"F"
_CONN = b"C"
_LOCAL = "NIXL_INIT_AGENT"


def wrap_metadata(raw: bytes, mode: PeerMode) -> bytes:
    return _MAGIC + (_FULL if mode is PeerMode.FULL else _CONN) + raw


def unwrap_metadata(metadata: bytes) -> tuple[bytes, PeerMode]:
    """Split kvwire's header off; bare NIXL metadata (no header) is taken as full."""
    if metadata.startswith(_MAGIC) and len(metadata) > len(_MAGIC):
        tag = metadata[len(_MAGIC) : len(_MAGIC) + 1]
        mode = PeerMode.FULL if tag == _FULL else PeerMode.NOTIF_ONLY
        return metadata[len(_MAGIC) + 1 :], mode
    return metadata, PeerMode.FULL


def _nixl(connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> tuple[Any, Any, Any]:
    # Before the first agent creates UCX's context, which reads them: a connect to an unreachable peer
    # must neither block the agent nor outlive the handshake's deadline by minutes (ucx_env.py).
    apply_ucx_defaults(connect_timeout_s)
    # UCX's ib modules make every process that created an agent segfault at exit on hosts with Debian's
    # ibverbs-providers (nixl-on-cpu.md); UCX reads this when the first agent is created.
    # Only where no InfiniBand device exists: on RDMA clusters those modules are the fast path.
    if not has_infiniband():
        os.environ.setdefault("UCX_MODULES", "^ib*")
    try:
        # NIXL configures its logger on import with a handler writing to the sys.stdout of that moment:
        # imported with stdout pointed at stderr, even its import-time lines stay off stdout.
        with contextlib.redirect_stdout(sys.stderr):
            import nixl._api as api
            import nixl._bindings as bindings
    except ImportError as exc:
        raise ConfigError(
            f"NIXL is not installed ({exc}): pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 "
            "(--no-deps: NIXL declares torch, which DRAM transfers do not need; `make venv` does this)"
        ) from exc

    _route_nixl_logging()
    return api.nixl_agent, api.nixl_agent_config, bindings


def _route_nixl_logging() -> None:
    """NIXL's Python layer logs through its own handler on *stdout* (``nixl.logging``'s "consoleHandler"),
    mixing its lines into whatever the process prints there, in its own format: hand them to the
    application's logging instead (logger ``nixl``). NIXL's C++ core (absl) and UCX write to stderr
    themselves, from C, out of reach of Python's logging."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        if handler.get_name() == "consoleHandler" or getattr(handler, "stream", None) is sys.stdout:
            nixl_log.removeHandler(handler)
    nixl_log.propagate = True


def _translate(exc: Exception, what: str, bindings: Any) -> TransportError:
    if isinstance(exc, bindings.nixlRemoteDisconnectError):
        return PeerDisconnected(f"{what}: peer disconnected ({exc})")
    if isinstance(exc, bindings.nixlNotFoundError):
        return NotAddressable(f"{what}: NIXL_ERR_NOT_FOUND ({exc})")
    return TransferFailed(f"{what}: {type(exc).__name__} ({exc})")


def _desc_array(descs: Sequence[Desc]) -> np.ndarray:
    out = np.empty((len(descs), 3), dtype=np.uint64)
    for i, d in enumerate(descs):
        out[i] = (d.addr, d.length, d.device_id)
    return out


def _indices(idx: Sequence[int], size: int, side: str) -> np.ndarray:
    arr = np.asarray(idx, dtype=np.int32)
    if arr.ndim != 1:
        raise TransferFailed(f"{side} indices must be one-dimensional")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= size):
        raise TransferFailed(f"{side} index out of range for a list of {size}")
    return arr


class NixlAgent(PeerTableAgent[PeerEntry]):
    """One NIXL agent with the UCX backend and the progress thread off."""

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        *,
        busy_grace_s: float = DEFAULT_GRACE_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        nixl_agent, nixl_agent_config, self._b = _nixl(connect_timeout_s)
        self.name = name
        self._backends = list(backends)
        try:
            config = nixl_agent_config(enable_prog_thread=False, backends=self._backends)
            self._agent: Any = nixl_agent(name, config)
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {name}: {exc}") from exc
        self._regs: dict[int, tuple[Registration, Any, object]] = {}
        self._tokens = itertools.count(1)
        self._epochs = itertools.count(1)
        self._peers: dict[str, PeerEntry] = {}
        self._dlists: list[DescListHandle] = []
        self._xfers: list[XferHandle] = []
        self._inbox: dict[str, list[bytes]] = {}
        self._closed = False
        self._warmed = False  # warm_up ran
        # Every call on self._agent holds self._calls's lock (see the module docstring).
        self._calls = CallWorker(name, busy_grace_s)
        self._md_full: bytes | None = None  # cached: the side channel must answer while a load is stuck
        self._md_conn: bytes | None = None
        with suppress(TransportError):
            self.conn_metadata()  # now, while nothing can hold the agent
        self.skipped_progress = 0  # progress calls skipped because a stuck call held the agent

    @property
    def raw_agent(self) -> Any:
        """The underlying ``nixl_agent`` (benchmarks time raw NIXL calls through it)."""
        self._check_open()
        return self._agent

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosed(f"agent {self.name} is closed")

    @contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Hold the agent (``AgentBusy`` if a stuck call holds it) and translate NIXL's exceptions."""
        with self._calls.hold(what):
            try:
                yield
            except TransportError:
                raise
            except Exception as exc:
                raise _translate(exc, what, self._b) from exc

    def stalled_s(self, now: float | None = None) -> float:
        return self._calls.stalled_s(now)

    @property
    def stuck_calls(self) -> int:
        return self._calls.stuck_calls

    def warm_up(self) -> None:
        """UCX sets up a worker's first endpoint lazily, in the agent's first load of a remote agent: that
        load costs 10-30 ms where later ones cost about 1 ms, and without this it lands in the first
        request's handshake (D's notif-only one with P). Load, then unload, a throwaway agent's metadata
        (one throwaway per process). Once per agent: NIXL 1.5.1 keeps the TCP connection of an unloaded
        peer that is still alive (the throwaway is), so each warm-up cost two sockets for good, and a
        connector started again on the same agents warmed it again (found by a review)."""
        if self._warmed:
            return
        self.remove_peer(self.add_peer(_spare_metadata()))
        self._warmed = True

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
        desc = Desc(addr, length, device_id)
        with self._calls.hold("register_memory"):
            try:
                raw = self._agent.register_memory(_desc_array([desc]), kind.value)
            except Exception as exc:
                raise RegistrationError(f"register {length} B of {kind.value} failed: {exc}") from exc
            self._refresh_metadata()
        reg = Registration(addr, length, kind, device_id, next(self._tokens))
        self._regs[reg.token] = (reg, raw, owner)
        return reg

    def deregister(self, reg: Registration) -> None:
        self._check_open()
        entry = self._regs.pop(reg.token, None)
        if entry is None:
            raise RegistrationError(f"not registered here: {reg}")
        with self._calls.hold("deregister_memory"):
            try:
                self._agent.deregister_memory(entry[1])
            except Exception as exc:
                raise RegistrationError(f"deregister failed: {exc}") from exc
            finally:
                self._refresh_metadata()

    def _refresh_metadata(self) -> None:
        """Recompute the full metadata (lock held) when registrations change rather than when a peer asks:
        the side channel then answers even while a stuck load holds the agent."""
        try:
            self._md_full = wrap_metadata(bytes(self._agent.get_agent_metadata()), PeerMode.FULL)
        except Exception:
            self._md_full = None  # computed on demand instead

    # -- metadata and peers --------------------------------------------------------------------------
    def metadata(self) -> bytes:
        self._check_open()
        md = self._md_full
        if md is None:
            with self._boundary("metadata"):
                md = wrap_metadata(bytes(self._agent.get_agent_metadata()), PeerMode.FULL)
                self._md_full = md  # under the lock: a registration cannot slip between get and set
        return md

    def conn_metadata(self) -> bytes:
        self._check_open()
        if self._md_conn is None:  # connection info never changes in an agent's life
            with self._boundary("conn_metadata"):
                empty = self._b.nixlRegDList(self._b.DRAM_SEG)
                raw = self._agent.get_partial_agent_metadata(empty, True, self._backends)
            self._md_conn = wrap_metadata(bytes(raw), PeerMode.NOTIF_ONLY)
        return self._md_conn

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        raw, mode = unwrap_metadata(metadata)
        with self._calls.hold("add_remote_agent"):
            name = self._load_raw(raw)
        return self._loaded(name, mode)

    async def load_peer(self, metadata: bytes, timeout_s: float) -> str:
        self._check_open()
        raw, mode = unwrap_metadata(metadata)
        known = set(self._peers)
        name = await self._calls.call(
            lambda: self._load_raw(raw), timeout_s, "add_remote_agent", undo=self._undo_load(known)
        )
        self._check_open()
        return self._loaded(name, mode)

    def _load_raw(self, raw: bytes) -> str:
        """NIXL's load (the lock held by the caller); it may block in UCX's connect for minutes."""
        try:
            loaded = self._agent.add_remote_agent(raw)
        except Exception as exc:
            raise TransportError(f"cannot load remote agent metadata: {type(exc).__name__} {exc}") from exc
        return loaded.decode() if isinstance(loaded, bytes) else str(loaded)

    def _undo_load(self, known: set[str]) -> Callable[[str], None]:
        def undo(name: str) -> None:
            # An abandoned load that succeeded late: unload what nobody asked for any more. A peer loaded
            # before it (notif-only, upgraded by this load) stays: its entry serves notif-only callers.
            if name not in known and name not in self._peers and self._agent is not None:
                self._agent.remove_remote_agent(name)

        return undo

    def _loaded(self, name: str, mode: PeerMode) -> str:
        """Record a load in the peer table (the caller's thread: the table is never written elsewhere)."""
        current = self._peers.get(name)
        if current is None:
            self._peers[name] = PeerEntry(mode, next(self._epochs))
        elif mode is PeerMode.FULL:
            # NIXL accepts the full metadata over a notif-only entry (checked on 1.5.1): upgrade in place.
            current.mode = PeerMode.FULL
        # Connection-only metadata over a full entry leaves it full: it serves notif-only callers as is.
        return name

    def remove_peer(self, peer: str) -> None:
        self._forget_peer(peer)
        # Deferred while a stuck call holds the agent: once it returns, the removal runs before any later
        # load of the same name (the worker runs in order), which NIXL requires (nixl-faults.md, Restart).
        self._nixl_or_defer(lambda agent: agent.remove_remote_agent(peer), f"remove {peer}")

    def _nixl_or_defer(self, fn: Callable[[Any], object], what: str) -> None:
        """A release or removal on the NIXL agent: now, or after the stuck call (errors are raised only
        when it runs now)."""
        failure: list[Exception] = []

        def run() -> None:
            if self._agent is None:
                return  # closed meanwhile: the teardown released everything
            try:
                fn(self._agent)
            except Exception as exc:
                failure.append(exc)

        if self._calls.run_or_defer(run, what) and failure:
            raise _translate(failure[0], what, self._b) from failure[0]

    # -- descriptor lists ----------------------------------------------------------------------------
    def prep_local(self, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        self._check_open()
        with self._boundary("prep_local"):
            raw = self._agent.prep_xfer_dlist(_LOCAL, _desc_array(descs), kind.value)
        handle = DescListHandle(None, tuple(descs), raw, kind=kind)
        self._dlists.append(handle)
        return handle

    def prep_remote(self, peer: str, descs: Sequence[Desc], kind: MemKind = MemKind.DRAM) -> DescListHandle:
        self._check_open()
        entry = self._full_peer(peer)
        with self._boundary(f"prep_remote {peer}"):
            raw = self._agent.prep_xfer_dlist(peer, _desc_array(descs), kind.value)
        handle = DescListHandle(peer, tuple(descs), raw, kind=kind, epoch=entry.epoch)
        self._dlists.append(handle)
        return handle

    def release_dlist(self, handle: DescListHandle) -> None:
        if handle.released:
            return
        handle.released = True
        if handle in self._dlists:
            self._dlists.remove(handle)
        if not self._closed and handle.raw is not None:
            raw = handle.raw
            self._nixl_or_defer(lambda agent: agent.release_dlist_handle(raw), "release_dlist")

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
        if lidx.size != ridx.size or lidx.size == 0:
            raise TransferFailed(f"{lidx.size} local indices and {ridx.size} remote ones")
        nbytes = sum(local.descs[i].length for i in lidx.tolist())
        with self._boundary(f"{op.value} to {peer}"):
            raw = self._agent.make_prepped_xfer(op.value, local.raw, lidx, remote.raw, ridx, notif or b"")
        return self._start(XferHandle(op, peer, nbytes, raw))

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
        self._full_peer(peer)
        if len(local) != len(remote):
            raise TransferFailed(f"{len(local)} local descriptors but {len(remote)} remote ones")
        if not local:
            raise TransferFailed("a transfer needs at least one descriptor")
        with self._boundary(f"{op.value} to {peer}"):
            ldescs = self._agent.get_xfer_descs(_desc_array(local), kind.value)
            rdescs = self._agent.get_xfer_descs(_desc_array(remote), kind.value)
            raw = self._agent.initialize_xfer(op.value, ldescs, rdescs, peer, notif or b"")
        return self._start(XferHandle(op, peer, sum(d.length for d in local), raw))

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
        self._full_peer(peer)
        lo, re = check_desc_arrays(local, remote)
        with self._boundary(f"{op.value} to {peer}"):
            # NIXL reads a C-contiguous uint64 [n, 3] array in C++; int64 rows were checked non-negative,
            # so viewing them as uint64 is exact and copies nothing.
            ldescs = self._agent.get_xfer_descs(lo.view(np.uint64), kind.value)
            rdescs = self._agent.get_xfer_descs(re.view(np.uint64), kind.value)
            raw = self._agent.initialize_xfer(op.value, ldescs, rdescs, peer, notif or b"")
        return self._start(XferHandle(op, peer, int(lo[:, 1].sum()), raw))

    def _start(self, handle: XferHandle) -> XferHandle:
        try:
            with self._calls.hold("transfer"):
                state = self._agent.transfer(handle.raw)
        except AgentBusy:
            self._drop_raw(handle)
            raise
        except Exception as exc:
            self._drop_raw(handle)
            raise _translate(exc, f"{handle.op.value} to {handle.peer}", self._b) from exc
        if state == "ERR":
            self._drop_raw(handle)
            raise TransferFailed(f"{handle.op.value} to {handle.peer}: NIXL could not post it")
        handle.state = XferStatus.DONE if state == "DONE" else XferStatus.IN_PROGRESS
        self._xfers.append(handle)
        return handle

    def status(self, handle: XferHandle) -> XferStatus:
        self._check_pollable(handle)
        if handle.state is not XferStatus.IN_PROGRESS:
            return handle.state
        try:
            state = self._calls.held_call("check_xfer_state", self._agent.check_xfer_state, handle.raw)
        except AgentBusy:
            return handle.state  # not polled: the transfer's own deadline still applies
        except Exception as exc:  # NIXL raises on a dead peer instead of answering "ERR"
            handle.state = XferStatus.FAILED
            handle.failed_reason = f"{type(exc).__name__}: {exc}"
            return handle.state
        if state == "DONE":
            handle.state = XferStatus.DONE
        elif state == "ERR":
            handle.state = XferStatus.FAILED
            handle.failed_reason = "NIXL reported ERR"
        return handle.state

    def release(self, handle: XferHandle) -> None:
        if handle.released:
            return
        handle.released = True
        if handle in self._xfers:
            self._xfers.remove(handle)
        if not self._closed:
            self._drop_raw(handle)

    def _drop_raw(self, handle: XferHandle) -> None:
        # Releasing an in-flight handle cancels it; if NIXL refuses, its own finaliser retries at exit.
        try:
            self._nixl_or_defer(lambda agent: agent.release_xfer_handle(handle.raw), "release_xfer_handle")
        except TransportError as exc:
            handle.failed_reason = handle.failed_reason or f"release failed: {exc}"

    # -- notifications -------------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        self._check_notif_peer(peer)
        try:
            with self._calls.hold("send_notif"):
                self._agent.send_notif(peer, msg)
        except AgentBusy:
            raise
        except Exception as exc:
            if isinstance(exc, self._b.nixlNotFoundError):
                raise PeerNotFound(f"send_notif to {peer}: {exc}") from exc
            raise _translate(exc, f"send_notif to {peer}", self._b) from exc

    def progress(self) -> None:
        self._check_open()
        # The UCX backend sends a WRITE's attached notification from the status check that sees the
        # data complete, so transfers in flight are polled here too.
        for handle in self._xfers:
            if handle.state is XferStatus.IN_PROGRESS:
                self.status(handle)
        try:
            new: dict[str, list[bytes]] = self._calls.held_call("progress", self._agent.get_new_notifs)
        except AgentBusy:
            # Nothing is lost: UCX keeps what arrives until the agent is progressed again.
            self.skipped_progress += 1
            return
        except TransportError:
            raise
        except Exception as exc:
            raise _translate(exc, "progress", self._b) from exc
        for sender, msgs in new.items():
            self._inbox.setdefault(str(sender), []).extend(bytes(m) for m in msgs)

    # -- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything now, or (a stuck call holds the agent) once that call returns: closing never
        waits on the network. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._calls.run_or_defer(self._teardown, "close")
        self._calls.close()

    def _teardown(self) -> None:
        # Best effort, straight on NIXL (the agent is already marked closed): close must finish even when
        # a peer is already gone.
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for xfer in self._xfers:
            xfer.released = True
            with suppress(Exception):
                agent.release_xfer_handle(xfer.raw)
        for dlist in self._dlists:
            dlist.released = True
            with suppress(Exception):
                agent.release_dlist_handle(dlist.raw)
        for peer in self._peers:
            with suppress(Exception):
                agent.remove_remote_agent(peer)
        for _reg, raw, _owner in self._regs.values():
            with suppress(Exception):
                agent.deregister_memory(raw)
        self._xfers.clear()
        self._dlists.clear()
        self._peers.clear()
        self._regs.clear()


_spare_lock = threading.Lock()
_spare: list[NixlAgent] = []  # the process's throwaway agent for warm_up, created once


def _spare_metadata() -> bytes:
    with _spare_lock:
        if not _spare:
            # Creating an agent costs 100+ ms: one per process, kept (idle) for the agents warmed later.
            _spare.append(NixlAgent(f"kvwire-warmup/{os.getpid()}/{uuid.uuid4().hex[:12]}"))
        return _spare[0].metadata()


def _create(name: str, options: AgentOptions) -> NixlAgent:
    if options.connect_timeout_s is None:
        return NixlAgent(name)
    return NixlAgent(name, connect_timeout_s=options.connect_timeout_s)


def _fresh_factory() -> FullAgentFactory:
    # NIXL agents of one process reach each other: the class is the factory.
    return NixlAgent


TRANSPORT = Transport(name="nixl", create=_create, conformance_factory=_fresh_factory, ucx=True)
