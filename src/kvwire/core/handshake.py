"""The handshake rules of one local rank as a sans-IO core: ``actions = core.handle(now, input)``.

``kvwire.handshake.manager.HandshakeManager`` is its driver (sockets, the agent, asyncio tasks) and the
simulator (``kvwire.testing.sim``) another: neither holds a rule. What the core decides:

* the cache: an entry per peer address and rank, carrying the peer's (engine_id, incarnation); a caller
  that names another incarnation or engine id refreshes it (the entry serves until the reply says whose
  it is; a restarted engine usually has a new id, so a cached id other than the one named is no answer);
  a reply from another engine than the one named is ``PeerReplaced`` (its KV is gone: ``peer_dead``); a
  reply from another life replaces the entry (its agent unloaded first: NIXL breaks an entry re-added under a
  live name);
* one handshake in flight per address (later callers join it: ``Join``, counted as deduplicated);
* NOTIF_ONLY -> FULL is an upgrade that keeps the clock offset already measured; a FULL entry serves
  NOTIF_ONLY callers;
* the deadline (``timeout_s``) over every attempt and the load; retries of a peer that did not answer
  (``retries``, exponential backoff up to ``MAX_BACKOFF_S`` times the jitter the driver drew);
* the circuit breaker (``kvwire.core.breaker``): which failures trip it and for which incarnation;
* the allow list (an address not in ``allowed_peers`` is never dialled);
* idle peers (``Reap``: unloaded past ``ttl_s``), ``Forget`` (an engine life is over), an agent whose
  process is gone (``ForgetAgent``), ``Close``;
* each address's ``PeerHandshake`` (``protocol/states.py``, ``HANDSHAKE_TABLE``).

The driver's contract: a ``Start`` is followed by ``Attempt``; each ``Fetch`` ends with ``FetchOk`` or
``FetchErr``, each ``Sleep`` with ``Attempt``, each ``Load`` with ``LoadOk`` or ``Failed``; a flight
ends with one ``Loaded`` or ``Fail`` (a cancelled one is told with ``Failed``). ``Unload`` is executed at
once. Exceptions are values here: the core raises nothing, it answers ``Refuse`` or ``Fail``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import assert_never

from kvwire.core.breaker import Breaker
from kvwire.core.handshake_io import (
    Answered,
    Attempt,
    Close,
    Fail,
    Failed,
    FailureReason,
    Fetch,
    FetchErr,
    FetchOk,
    Forget,
    ForgetAgent,
    Forgot,
    HsAction,
    HsInput,
    Join,
    Load,
    Loaded,
    LoadOk,
    Lookup,
    Ready,
    Reap,
    Reaped,
    Refuse,
    Sleep,
    Start,
    Touch,
    Unload,
    Want,
)
from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import (
    AgentBusy,
    HandshakeTimeout,
    IncompatiblePeer,
    KvwireError,
    LayoutError,
    NobodyListens,
    NoSuchRank,
    PeerNotAllowed,
    PeerReplaced,
    PeerUnreachable,
    TransportError,
    Unauthorized,
)
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.messages import FailReason
from kvwire.protocol.states import HandshakeEvent, HandshakeState, PeerHandshake
from kvwire.protocol.types import PeerMode

MAX_BACKOFF_S = 2.0


@dataclass
class HandshakeManagerStats:
    """Running counters of one handshake core (a metrics exporter reads these attributes); not
    ``kvwire.metrics.HandshakeStats``, which records one completed handshake."""

    handshakes: Counter[PeerMode] = field(default_factory=Counter)  # completed, by resulting mode
    upgrades: int = 0  # NOTIF_ONLY -> FULL, also counted in handshakes[FULL]
    deduped: int = 0  # ensure() calls that joined a handshake already in flight
    cache_hits: int = 0
    retries: int = 0
    replaced: int = 0  # entries dropped because the peer came back with a new incarnation
    forgotten: int = 0
    not_allowed: int = 0  # ensure() calls refused at once: the address is not in allowed_peers
    failures: Counter[FailureReason] = field(default_factory=Counter)
    # Most recent durations (seconds), by mode; bounded so a long-lived engine does not grow it.
    durations_s: dict[PeerMode, deque[float]] = field(
        default_factory=lambda: {mode: deque(maxlen=1024) for mode in PeerMode}
    )


def satisfies(have: PeerMode, want: PeerMode) -> bool:
    return have is PeerMode.FULL or want is PeerMode.NOTIF_ONLY


def max_mode(a: PeerMode, b: PeerMode) -> PeerMode:
    return PeerMode.FULL if PeerMode.FULL in (a, b) else PeerMode.NOTIF_ONLY


def failure_reason(exc: BaseException) -> FailureReason:
    for cls, reason in (
        (HandshakeTimeout, FailureReason.TIMEOUT),
        (PeerUnreachable, FailureReason.UNREACHABLE),
        (IncompatiblePeer, FailureReason.INCOMPATIBLE),
        (PeerReplaced, FailureReason.REPLACED),
        (LayoutError, FailureReason.INCOMPATIBLE),
        (Unauthorized, FailureReason.UNAUTHORIZED),
        (NoSuchRank, FailureReason.NO_SUCH_RANK),
        (TransportError, FailureReason.TRANSPORT),
    ):
        if isinstance(exc, cls):
            return reason
    return FailureReason.BAD_REPLY


def refusal(exc: BaseException) -> FailReason:
    """A failed handshake's reason, as the protocol core hears it (``HandshakeDone.reason``): permanent
    misconfigurations keep their own (the engine answers them with an error the client does not retry),
    another engine at the address is the named one's death (``peer_dead``, as another life of it is: the
    request's KV is gone, a retry may cure it), the rest is handshake_failed."""
    if isinstance(exc, PeerReplaced):
        return FailReason.PEER_DEAD
    if isinstance(exc, IncompatiblePeer):
        return FailReason.INCOMPATIBLE
    if isinstance(exc, Unauthorized):
        return FailReason.UNAUTHORIZED
    return FailReason.HANDSHAKE_FAILED


def trips_breaker(exc: BaseException) -> bool:
    """A failure of the address on the network that cost time: not a refusal it answered, not a refused
    connection (fast, and what a restarting peer answers for a moment), not our own agent held."""
    if isinstance(exc, AgentBusy | NobodyListens) or isinstance(exc.__cause__, AgentBusy):
        return False
    if isinstance(exc.__cause__, TransportError):
        return True  # the load of the peer's agent failed in UCX (an endpoint it could not create)
    return failure_reason(exc) in (FailureReason.TIMEOUT, FailureReason.UNREACHABLE, FailureReason.TRANSPORT)


# Handshake machines kept per local rank; idle ones (no peer, no flight) beyond it go, oldest first.
MAX_MACHINES = 4096


@dataclass
class _Flight:
    """The one handshake in flight for an address."""

    mode: PeerMode
    base: PeerRank | None  # a notif-only entry to upgrade
    stale: PeerRank | None  # any entry the answer may replace
    life: str | None  # the incarnation sought, if known (a network failure trips the breaker for it)
    engine: str | None  # the engine sought, if known (its sign of life closes the circuit)
    upgrade: bool
    machine: PeerHandshake
    deadline: float
    started: float
    attempt: int = -1


class HandshakeCore:
    """The handshake rules of one local rank (see the module's docstring)."""

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        clock_samples: int = 3,
        breaker: Breaker | None = None,
        allowed: PeerAllowList | None = None,
    ) -> None:
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.clock_samples = clock_samples
        self.breaker = breaker if breaker is not None else Breaker()
        self.allowed = allowed if allowed is not None else PeerAllowList()
        self.peers: dict[PeerAddress, PeerRank] = {}
        # The life of each address's entry; REMOVED ones are replaced on use.
        self.machines: dict[PeerAddress, PeerHandshake] = {}
        self.last_used: dict[str, float] = {}  # engine_id -> the driver's clock
        self.flights: dict[PeerAddress, _Flight] = {}
        self.stats = HandshakeManagerStats()
        self._out: list[HsAction] = []

    def handle(self, now: float, inp: HsInput) -> list[HsAction]:
        self._out = []
        match inp:
            case Lookup():
                self._lookup(now, inp)
            case Want():
                self._want(now, inp)
            case Answered(mode, engine_id, peer):
                if satisfies(peer.mode, mode):
                    self._checked(now, peer, engine_id)
            case Attempt(addr):
                self._attempt(now, addr)
            case FetchOk():
                self._fetched(now, inp)
            case FetchErr(addr, error, jitter):
                self._fetch_failed(now, addr, error, jitter)
            case LoadOk(addr, peer):
                self._loaded(now, addr, peer)
            case Failed(addr, error):
                self._fail(now, addr, error)
            case Forget(engine_id, incarnation):
                self._forget(engine_id, incarnation)
            case ForgetAgent(agent_name):
                self._forget_agent(agent_name)
            case Touch(engine_id):
                # Only an engine this rank loaded: a sender-chosen id must not add an entry (kept an hour).
                if engine_id in self.last_used:
                    self.last_used[engine_id] = now
                self.breaker.heard(engine_id)
            case Reap(in_use, ttl_s):
                self._reap(now, in_use, ttl_s)
            case Close():
                self._close()
            case _:
                assert_never(inp)
        out, self._out = self._out, []
        return out

    def state(self, addr: PeerAddress) -> HandshakeState:
        machine = self.machines.get(addr)
        return HandshakeState.UNKNOWN if machine is None else machine.state

    # -- callers ---------------------------------------------------------------------------------------

    def _lookup(self, now: float, q: Lookup) -> None:
        if q.dial and not self.allowed.allows(q.addr.host):
            self.stats.not_allowed += 1
            a = q.addr
            self._out.append(
                Refuse(PeerNotAllowed(f"{a.host}:{a.port} is not in allowed_peers: not dialled"))
            )
            return
        cached = self.peers.get(q.addr)
        if (
            cached is None
            or q.incarnation not in (None, cached.incarnation)
            or q.engine_id not in (None, cached.engine_id)  # may be stale: the named engine restarted there
            or not satisfies(cached.mode, q.mode)
        ):
            return
        self.stats.cache_hits += 1
        self._checked(now, cached, q.engine_id)

    def _checked(self, now: float, peer: PeerRank, engine_id: str | None) -> None:
        if engine_id is not None and peer.engine_id != engine_id:
            msg = (
                f"{peer.host}:{peer.port} is engine {peer.engine_id}/{peer.incarnation}, not {engine_id}: "
                "that engine restarted under a new id, or another took its address"
            )
            self.stats.failures[FailureReason.REPLACED] += 1
            self._out.append(Refuse(PeerReplaced(msg)))
            return
        self.last_used[peer.engine_id] = now
        self._out.append(Ready(peer))

    def _want(self, now: float, w: Want) -> None:
        addr = w.addr
        cached = self.peers.get(addr)
        fresh = (
            cached is not None
            and w.incarnation in (None, cached.incarnation)
            and w.engine_id in (None, cached.engine_id)
        )
        if cached is not None and fresh and satisfies(cached.mode, w.mode):
            self._checked(now, cached, w.engine_id)
            return
        if addr in self.flights:
            if not w.joined:
                self.stats.deduped += 1
            self._out.append(Join(addr))
            return
        # The life asked for, else the cached one: a trip by another life does not hold it.
        life = w.incarnation if w.incarnation is not None or cached is None else cached.incarnation
        try:
            self.breaker.check_at(now, addr.host, addr.port, life)
        except KvwireError as exc:  # CircuitOpen: counted by the breaker, not logged
            self._out.append(Refuse(exc))
            return
        mode = w.mode if cached is None or fresh else max_mode(w.mode, cached.mode)
        engine = w.engine_id if w.engine_id is not None or cached is None else cached.engine_id
        self._start(now, addr, mode, cached if fresh else None, cached, life, engine)

    def _start(
        self,
        now: float,
        addr: PeerAddress,
        mode: PeerMode,
        base: PeerRank | None,
        stale: PeerRank | None,
        life: str | None,
        engine: str | None = None,
    ) -> None:
        upgrade = base is not None and base.mode is PeerMode.NOTIF_ONLY and mode is PeerMode.FULL
        machine = self._machine(addr)
        if stale is None:
            machine.handle(HandshakeEvent.FETCH)
        elif upgrade:
            machine.handle(HandshakeEvent.UPGRADE)
        # else a refresh: the entry stays in service (and in its state) until the reply says whose it is
        deadline = now + self.timeout_s
        self.flights[addr] = _Flight(mode, base, stale, life, engine, upgrade, machine, deadline, now)
        self._out.append(Start(addr))

    # -- one flight ------------------------------------------------------------------------------------

    def _attempt(self, now: float, addr: PeerAddress) -> None:
        f = self.flights[addr]
        f.attempt += 1
        left = f.deadline - now
        if left <= 0 or f.attempt > self.retries:
            self._fail(now, addr, HandshakeTimeout(f"{addr}: no answer within {self.timeout_s:.3g} s"))
            return
        samples = 1 if f.upgrade else self.clock_samples
        # An attempt that another may follow gets half the time left: one connection that hangs (accepted,
        # never answered: a loaded CI host lost a whole 20 s budget so, where a second connection answered
        # in 31 ms) then costs half the budget, not all of it.
        budget = left / 2 if f.attempt < self.retries else left
        self._out.append(Fetch(addr, f.mode is PeerMode.NOTIF_ONLY, samples, budget, f.attempt))

    def _fetch_failed(self, now: float, addr: PeerAddress, error: BaseException, jitter: float) -> None:
        """Connection failures and unanswered attempts back off and retry while attempts and time are
        left (a peer that never answers still fails at the deadline, once)."""
        f = self.flights[addr]
        if isinstance(error, PeerUnreachable | HandshakeTimeout):
            pause = min(self.backoff_s * 2**f.attempt, MAX_BACKOFF_S) * jitter
            if f.attempt < self.retries and now + pause < f.deadline:
                self.stats.retries += 1
                self._out.append(Sleep(addr, pause))
                return
        self._fail(now, addr, error)

    def _fetched(self, now: float, got: FetchOk) -> None:
        addr, f = got.addr, self.flights[got.addr]
        stale = f.stale
        if stale is not None and (stale.engine_id, stale.incarnation) != (got.engine_id, got.incarnation):
            self._drop(addr, stale)  # REMOVE: that life is over
            self.stats.replaced += 1
            f.upgrade = False
            f.machine = self._machine(addr)
            f.machine.handle(HandshakeEvent.FETCH)  # the new life, found by this fetch
        self._out.append(Load(addr, f.mode, f.deadline - now))

    def _loaded(self, now: float, addr: PeerAddress, peer: PeerRank) -> None:
        f = self.flights.pop(addr)
        self.breaker.succeeded(addr.host, addr.port)
        if f.upgrade and f.base is not None:
            peer = dataclasses.replace(peer, clock_offset_s=f.base.clock_offset_s)
        self.peers[addr] = peer
        self._entry_loaded(addr, f.machine, f.mode)
        self.last_used[peer.engine_id] = now
        self.stats.handshakes[f.mode] += 1
        self.stats.upgrades += int(f.upgrade)
        self.stats.durations_s[f.mode].append(now - f.started)
        self._out.append(Loaded(addr, peer, f.upgrade))

    def _fail(self, now: float, addr: PeerAddress, error: BaseException) -> None:
        f = self._fail_flight(addr)
        reason = None
        if isinstance(error, KvwireError):
            reason = failure_reason(error)
            self.stats.failures[reason] += 1
            if trips_breaker(error):
                self.breaker.failed_at(now, addr.host, addr.port, f.life, f.engine)
        self._out.append(Fail(addr, f.mode, error, reason))

    def _fail_flight(self, addr: PeerAddress) -> _Flight:
        f = self.flights.pop(addr)
        # A refresh's entry stays as it was; a fetch or an upgrade fails.
        if f.machine.state is HandshakeState.FETCHING:
            f.machine.handle(HandshakeEvent.FETCH_FAILED)
        elif f.machine.state is HandshakeState.UPGRADING:
            f.machine.handle(HandshakeEvent.UPGRADE_FAILED)
        return f

    def _machine(self, addr: PeerAddress) -> PeerHandshake:
        """The machine of ``addr``'s entry; a new one where there is none or the last life was removed."""
        machine = self.machines.get(addr)
        if machine is None or machine.is_terminal:
            machine = self.machines[addr] = PeerHandshake()
            if len(self.machines) > MAX_MACHINES:
                self._prune_machines()
        return machine

    def _prune_machines(self) -> None:
        """Peers name the addresses (a ``push_reg``'s host and port): keep the table bounded by dropping the
        oldest machines of addresses with neither a peer loaded nor a handshake in flight (their state only
        says how the last handshake ended; a new one starts from UNKNOWN as for a first contact)."""
        for addr in list(self.machines):
            if len(self.machines) <= MAX_MACHINES:
                return
            if addr not in self.peers and addr not in self.flights:
                del self.machines[addr]

    def _entry_loaded(self, addr: PeerAddress, machine: PeerHandshake, mode: PeerMode) -> None:
        full = mode is PeerMode.FULL
        state = machine.state
        if machine.is_terminal:
            # Forgotten while the fetch ran, and its answer loads the peer again: a new life of the entry.
            machine = self._machine(addr)
            machine.handle(HandshakeEvent.FETCH)
        elif state is HandshakeState.NOTIF_ONLY and full:
            machine.handle(HandshakeEvent.UPGRADE)  # a refresh of the same life, answered in full
        elif state in (HandshakeState.NOTIF_ONLY, HandshakeState.FULL):
            return  # a refresh of the same life in the mode it had: nothing changes
        # FETCHING or UPGRADING (anything else raises IllegalTransition here)
        machine.handle(HandshakeEvent.LOADED_FULL if full else HandshakeEvent.LOADED_NOTIF_ONLY)

    # -- unloading -------------------------------------------------------------------------------------

    def _drop(self, addr: PeerAddress, peer: PeerRank) -> None:
        if self.peers.get(addr) is peer:
            del self.peers[addr]
            machine = self.machines.get(addr)
            if machine is not None and not machine.is_terminal:
                machine.handle(HandshakeEvent.REMOVE)
        # Another address may name the same remote agent (e.g. "localhost" and "127.0.0.1").
        if not any(p.agent_name == peer.agent_name for p in self.peers.values()):
            self._out.append(Unload(peer.agent_name))

    def _forget(self, engine_id: str, incarnation: str | None) -> None:
        for addr, peer in list(self.peers.items()):
            if peer.engine_id == engine_id and incarnation in (None, peer.incarnation):
                self._drop(addr, peer)
        if any(p.engine_id == engine_id for p in self.peers.values()):
            return
        if self.last_used.pop(engine_id, None) is not None:
            self.stats.forgotten += 1

    def _forget_agent(self, agent_name: str) -> None:
        for peer in self.peers.values():
            if peer.agent_name == agent_name:
                self._forget(peer.engine_id, peer.incarnation)
                self._out.append(Forgot(peer.engine_id, peer.incarnation))
                return

    def _reap(self, now: float, in_use: frozenset[str], ttl_s: float) -> None:
        last_used = self.last_used
        for engine_id in in_use:
            if engine_id in last_used:  # only loaded ones: a request's engine id is the caller's to choose
                last_used[engine_id] = now
        idle = [eid for eid, used in self.last_used.items() if now - used > ttl_s]
        for engine_id in idle:
            self._forget(engine_id, None)
            self._out.append(Reaped(engine_id))

    def _close(self) -> None:
        for addr in list(self.flights):  # cancelled before they ran (their Failed never came)
            self._fail_flight(addr)
        for addr, peer in list(self.peers.items()):
            self._drop(addr, peer)
        for machine in self.machines.values():
            if not machine.is_terminal:
                machine.handle(HandshakeEvent.REMOVE)
        self.machines.clear()
        self.last_used.clear()
