"""State machines of kvwire, as transition tables.

Theory of operation
-------------------
Three machines, each a table ``{(state, event): next_state}`` and a small class that holds the current
state. Drivers (the engine glue, with its sockets, threads and NIXL calls) turn what happens into events
and act on the states that come back; nothing here does I/O. An event the current state does not accept
raises ``IllegalTransition(role, state, event)``: a driver bug or a peer breaking the protocol, never
silently ignored. Races that are legal on the wire (a ``done`` crossing a ``cancel``) are self-loops in the
tables, so they are explicit too.

* ``PeerHandshake`` (role ``handshake``), one per life of a ``HandshakeManager`` entry (a remote rank's
  address as one engine life answered it), driven by the manager. D loads P notif-only (it only sends
  notifications); P loads D in full (it writes D's memory); a notif-only peer is upgraded in place. A
  failed fetch can be retried; a reaped, dead or replaced peer is REMOVED for good (a restart is a new
  incarnation, hence a new machine).
* ``ConsumerRequest`` (role ``consumer/push`` or ``consumer/pull``), one per request on D. The rule it
  enforces (DESIGN §3 item 2): D's blocks stay quarantined while any P rank may still write them, so every
  way out of WAITING other than DONE_ALL goes through a draining state (CANCELLING after a user cancel,
  FAILING after a failure), which only ENDED_ALL leaves: every P rank ended its registration (``done``,
  ``cancel_ack``, ``failed``, or dead plus a grace period). D may free the blocks only in a terminal state.
  ``RankTracker`` counts the ranks; ``ConsumerRequest``'s rank-level methods fire the aggregate events
  (DONE_ALL, ENDED_ALL) from it, so a driver cannot count wrong.
* ``ProducerRegistration`` (role ``producer``), one per (request, D rank) on P. Prefill end and ``push_reg``
  arrive in either order; both are needed before CONNECTING (full handshake with D, mapping, posting).
  A posted write cannot be recalled, so a cancel during WRITING waits in CANCEL_PENDING until every handle
  is finished: a write that completes delivered the ``done`` attached to it (DONE_SENT, no ``cancel_ack``),
  one that fails is answered ``cancel_ack``. DONE_SENT, CANCELLED and FAILED have each sent their one
  ending message to D; RELEASE (P's blocks freed) leads to FREED.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvwire.errors import IllegalTransition
from kvwire.protocol.messages import FailReason, TransferMode
from kvwire.protocol.ranks import RankEnd, RankKey, RankTracker

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True)
class TransitionTable(Generic[S, E]):
    """One machine's rules; ``states`` and ``events`` are the enums, kept for generating docs and tests."""

    role: str
    states: type[S]
    events: type[E]
    initial: S
    transitions: Mapping[tuple[S, E], S]
    terminal: frozenset[S]
    # ``transitions`` and ``terminal`` keyed by the members' ids: Enum.__hash__ is Python code, and each
    # request makes many lookups; members are singletons, so an id names exactly one member.
    _edges: dict[int, dict[int, S]] = field(init=False, repr=False, compare=False)
    _terminal_ids: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        edges: dict[int, dict[int, S]] = {id(state): {} for state in self.states}
        for (state, event), nxt in self.transitions.items():
            edges.setdefault(id(state), {})[id(event)] = nxt
        object.__setattr__(self, "_edges", edges)
        object.__setattr__(self, "_terminal_ids", frozenset(id(state) for state in self.terminal))

    def next_state(self, state: S, event: E) -> S:
        nxt = self._edges.get(id(state), {}).get(id(event))
        if nxt is None:
            raise IllegalTransition(self.role, state.name, event.name)
        return nxt

    def accepts(self, state: S, event: E) -> bool:
        return id(event) in self._edges.get(id(state), {})

    def is_terminal(self, state: S) -> bool:
        return id(state) in self._terminal_ids


class _Machine(Generic[S, E]):
    def __init__(self, table: TransitionTable[S, E], state: S | None = None) -> None:
        self._table = table
        self._state = table.initial if state is None else state

    @property
    def table(self) -> TransitionTable[S, E]:
        return self._table

    @property
    def role(self) -> str:
        return self._table.role

    @property
    def state(self) -> S:
        return self._state

    @property
    def is_terminal(self) -> bool:
        return self._table.is_terminal(self._state)

    def accepts(self, event: E) -> bool:
        return self._table.accepts(self._state, event)

    def handle(self, event: E) -> S:
        self._state = self._table.next_state(self._state, event)
        return self._state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role} {self._state.name}>"


def _table(rows: Iterable[tuple[S, Iterable[tuple[E, S]]]]) -> dict[tuple[S, E], S]:
    """Flatten ``[(state, [(event, next), ...]), ...]`` (easier to read than a flat dict) into a dict."""
    out: dict[tuple[S, E], S] = {}
    for state, edges in rows:
        for event, nxt in edges:
            if (state, event) in out:
                raise AssertionError(f"duplicate transition {state.name} x {event.name}")
            out[(state, event)] = nxt
    return out


# --- handshake per peer ----------------------------------------------------------------------------


class HandshakeState(enum.Enum):
    UNKNOWN = "unknown"
    FETCHING = "fetching"
    NOTIF_ONLY = "notif_only"
    UPGRADING = "upgrading"
    FULL = "full"
    FAILED = "failed"
    REMOVED = "removed"


class HandshakeEvent(enum.Enum):
    FETCH = "fetch"  # first fetch, or a retry after FAILED
    LOADED_NOTIF_ONLY = "loaded_notif_only"
    LOADED_FULL = "loaded_full"
    FETCH_FAILED = "fetch_failed"
    UPGRADE = "upgrade"
    UPGRADE_FAILED = "upgrade_failed"
    REMOVE = "remove"  # reaped, declared dead, or replaced by a new incarnation


_HS, _HE = HandshakeState, HandshakeEvent
HANDSHAKE_TABLE: TransitionTable[HandshakeState, HandshakeEvent] = TransitionTable(
    role="handshake",
    states=HandshakeState,
    events=HandshakeEvent,
    initial=_HS.UNKNOWN,
    terminal=frozenset({_HS.REMOVED}),
    transitions=_table(
        [
            (_HS.UNKNOWN, [(_HE.FETCH, _HS.FETCHING), (_HE.REMOVE, _HS.REMOVED)]),
            (
                _HS.FETCHING,
                [
                    (_HE.LOADED_NOTIF_ONLY, _HS.NOTIF_ONLY),
                    (_HE.LOADED_FULL, _HS.FULL),
                    (_HE.FETCH_FAILED, _HS.FAILED),
                    (_HE.REMOVE, _HS.REMOVED),
                ],
            ),
            (_HS.NOTIF_ONLY, [(_HE.UPGRADE, _HS.UPGRADING), (_HE.REMOVE, _HS.REMOVED)]),
            # A failed upgrade keeps the notif-only load: the peer can still be sent `failed`.
            (
                _HS.UPGRADING,
                [
                    (_HE.LOADED_FULL, _HS.FULL),
                    (_HE.UPGRADE_FAILED, _HS.NOTIF_ONLY),
                    (_HE.REMOVE, _HS.REMOVED),
                ],
            ),
            (_HS.FULL, [(_HE.REMOVE, _HS.REMOVED)]),
            (_HS.FAILED, [(_HE.FETCH, _HS.FETCHING), (_HE.REMOVE, _HS.REMOVED)]),
        ]
    ),
)


class PeerHandshake(_Machine[HandshakeState, HandshakeEvent]):
    def __init__(self, state: HandshakeState | None = None) -> None:
        super().__init__(HANDSHAKE_TABLE, state)

    @property
    def can_notify(self) -> bool:
        """The peer's agent is loaded: notifications can be sent to it (a full peer serves notif-only)."""
        return self.state in (_HS.NOTIF_ONLY, _HS.UPGRADING, _HS.FULL)

    @property
    def addressable(self) -> bool:
        """The peer's memory can be written or read."""
        return self.state is _HS.FULL


# --- consumer request (D) --------------------------------------------------------------------------


class ConsumerState(enum.Enum):
    ALLOCATED = "allocated"  # blocks allocated, nothing sent
    REGISTERING = "registering"  # handshakes (push: notif-only; pull: full) and push_regs going out
    WAITING = "waiting"  # push: every push_reg sent, counting done
    READING = "reading"  # pull: READs posted
    READY = "ready"  # KV complete; blocks are D's alone again
    CANCELLING = "cancelling"  # cancelled; waiting for every rank (or read) to end
    FAILING = "failing"  # failed; cancel sent to the other ranks, waiting for every rank to end
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class ConsumerTrigger(enum.Enum):
    REGISTER = "register"  # start the handshakes
    PUSH_REG_SENT = "push_reg_sent"  # push: the last push_reg is sent
    READ_POSTED = "read_posted"  # pull: every READ is posted
    RANK_DONE = "rank_done"
    RANK_FAILED = "rank_failed"
    RANK_CANCEL_ACKED = "rank_cancel_acked"
    RANK_DEAD = "rank_dead"
    DONE_ALL = "done_all"  # push: every rank sent done / pull: every READ finished
    READ_FAILED = "read_failed"  # pull: a READ failed
    HANDSHAKE_FAILED = "handshake_failed"
    TIMEOUT = "timeout"
    CANCEL = "cancel"
    ENDED_ALL = "ended_all"  # every rank ended its registration (pull: every READ handle is finished)
    RELEASE = "release"  # the request is over (decoded) and its blocks go back
    # This engine closes: its memory is deregistered, so nothing can land in the blocks or be read into
    # them, and no answer to a cancel will be read. Any live state ends ABORTED.
    SHUTDOWN = "shutdown"


_CS, _CE = ConsumerState, ConsumerTrigger
_RANK_EVENTS = (_CE.RANK_DONE, _CE.RANK_FAILED, _CE.RANK_CANCEL_ACKED, _CE.RANK_DEAD)
_DRAIN_COMMON: list[tuple[ConsumerState, list[tuple[ConsumerTrigger, ConsumerState]]]] = [
    (
        drain,
        [(ev, drain) for ev in _RANK_EVENTS]
        + [(_CE.CANCEL, drain), (_CE.HANDSHAKE_FAILED, drain), (_CE.ENDED_ALL, end)],
    )
    for drain, end in ((_CS.CANCELLING, _CS.ABORTED), (_CS.FAILING, _CS.FAILED))
]
_CONSUMER_COMMON: list[tuple[ConsumerState, list[tuple[ConsumerTrigger, ConsumerState]]]] = [
    (
        _CS.ALLOCATED,
        [(_CE.REGISTER, _CS.REGISTERING), (_CE.CANCEL, _CS.ABORTED), (_CE.TIMEOUT, _CS.FAILED)],
    ),
    (_CS.READY, [(_CE.RELEASE, _CS.FINISHED), (_CE.CANCEL, _CS.ABORTED)]),
]
# Push: a rank may answer (even `done`) before the last push_reg to the other ranks is out.
_PUSH_EARLY = [(_CE.RANK_DONE, None), (_CE.RANK_FAILED, _CS.FAILING), (_CE.RANK_DEAD, _CS.FAILING)]
_PUSH_ROWS = [
    (
        _CS.REGISTERING,
        [(ev, _CS.REGISTERING if nxt is None else nxt) for ev, nxt in _PUSH_EARLY]
        + [
            (_CE.PUSH_REG_SENT, _CS.WAITING),
            (_CE.HANDSHAKE_FAILED, _CS.FAILING),
            (_CE.TIMEOUT, _CS.FAILING),
            (_CE.CANCEL, _CS.CANCELLING),
        ],
    ),
    (
        _CS.WAITING,
        [(ev, _CS.WAITING if nxt is None else nxt) for ev, nxt in _PUSH_EARLY]
        + [(_CE.DONE_ALL, _CS.READY), (_CE.TIMEOUT, _CS.FAILING), (_CE.CANCEL, _CS.CANCELLING)],
    ),
]
# Pull: D's own READs land in D's blocks, so posted reads are drained like P's writes in push.
_PULL_ROWS = [
    (
        _CS.REGISTERING,
        [
            (_CE.READ_POSTED, _CS.READING),
            (_CE.HANDSHAKE_FAILED, _CS.FAILING),
            (_CE.TIMEOUT, _CS.FAILING),
            (_CE.CANCEL, _CS.CANCELLING),
        ],
    ),
    (
        _CS.READING,
        [
            (_CE.DONE_ALL, _CS.READY),
            (_CE.READ_FAILED, _CS.FAILING),
            (_CE.RANK_DEAD, _CS.FAILING),
            (_CE.TIMEOUT, _CS.FAILING),
            (_CE.CANCEL, _CS.CANCELLING),
        ],
    ),
]
_CONSUMER_TERMINAL = frozenset({_CS.FINISHED, _CS.ABORTED, _CS.FAILED})


def _shutdown_rows(
    rows: list[tuple[ConsumerState, list[tuple[ConsumerTrigger, ConsumerState]]]],
) -> list[tuple[ConsumerState, list[tuple[ConsumerTrigger, ConsumerState]]]]:
    """SHUTDOWN from every live state of a mode (its own rows' and the drains'): ABORTED."""
    live = [s for s, _ in rows if s not in _CONSUMER_TERMINAL] + [_CS.CANCELLING, _CS.FAILING]
    return [(s, [(_CE.SHUTDOWN, _CS.ABORTED)]) for s in live]


def _consumer_table(mode: TransferMode) -> TransitionTable[ConsumerState, ConsumerTrigger]:
    rows = _PUSH_ROWS if mode is TransferMode.PUSH else _PULL_ROWS
    drain = _DRAIN_COMMON
    if mode is TransferMode.PULL:  # pull drains read handles, not ranks' messages: only RANK_DEAD applies
        drain = [(s, [(e, n) for e, n in edges if e not in _RANK_EVENTS[:3]]) for s, edges in drain]
    return TransitionTable(
        role=f"consumer/{mode.value}",
        states=ConsumerState,
        events=ConsumerTrigger,
        initial=_CS.ALLOCATED,
        terminal=_CONSUMER_TERMINAL,
        transitions=_table([*_CONSUMER_COMMON, *rows, *drain, *_shutdown_rows([*_CONSUMER_COMMON, *rows])]),
    )


CONSUMER_TABLES: dict[TransferMode, TransitionTable[ConsumerState, ConsumerTrigger]] = {
    mode: _consumer_table(mode) for mode in TransferMode
}

_RANK_END_EVENT = {
    RankEnd.DONE: _CE.RANK_DONE,
    RankEnd.FAILED: _CE.RANK_FAILED,
    RankEnd.CANCEL_ACKED: _CE.RANK_CANCEL_ACKED,
    RankEnd.DEAD: _CE.RANK_DEAD,
}
_DRAINING = frozenset({_CS.CANCELLING, _CS.FAILING})


class ConsumerRequest(_Machine[ConsumerState, ConsumerTrigger]):
    """D's view of one request. ``handle`` takes raw events; in push mode, prefer the rank-level methods
    (``push_reg_sent``, ``rank_ended``, ``cancel``, ``fail``), which keep the ``RankTracker`` and fire
    DONE_ALL / ENDED_ALL at the right moment."""

    def __init__(
        self, mode: TransferMode, ranks: Iterable[RankKey], state: ConsumerState | None = None
    ) -> None:
        super().__init__(CONSUMER_TABLES[mode], state)
        self.mode = mode
        self.ranks = RankTracker(ranks)

    @property
    def blocks_quarantined(self) -> bool:
        """A peer may still write (or a READ still land in) the blocks: never reuse them now."""
        return self.state not in self.table.terminal and self.state not in (_CS.ALLOCATED, _CS.READY)

    @property
    def may_free_blocks(self) -> bool:
        return self.is_terminal

    @property
    def may_send_push_reg(self) -> bool:
        """Check right before sending a push_reg, and call ``push_reg_sent`` right after, with no await in
        between: once the request drains, ranks not yet registered are counted as ended."""
        return self.mode is TransferMode.PUSH and self.state in (_CS.ALLOCATED, _CS.REGISTERING)

    def push_reg_sent(self, rank: RankKey) -> ConsumerState:
        if not self.may_send_push_reg:
            raise IllegalTransition(self.role, self.state.name, _CE.PUSH_REG_SENT.name)
        if self.state is _CS.ALLOCATED:
            self.handle(_CE.REGISTER)
        self.ranks.register(rank)
        if self.ranks.all_registered:
            self.handle(_CE.PUSH_REG_SENT)
        return self._settle()

    def rank_ended(self, rank: RankKey, how: RankEnd) -> ConsumerState:
        """A rank's ``done`` / ``failed`` / ``cancel_ack`` arrived, or it was declared dead."""
        event = _RANK_END_EVENT[how]
        if not self.accepts(event):  # check first: a refused event must not touch the tracker
            raise IllegalTransition(self.role, self.state.name, event.name)
        self.ranks.end(rank, how)
        self.handle(event)
        return self._settle()

    def cancel(self) -> ConsumerState:
        self.handle(_CE.CANCEL)
        return self._settle()

    def shutdown(self) -> ConsumerState:
        """This engine closes (``ConsumerTrigger.SHUTDOWN``): ABORTED from any live state."""
        return self.handle(_CE.SHUTDOWN)

    def fail(self, event: ConsumerTrigger) -> ConsumerState:
        """TIMEOUT, HANDSHAKE_FAILED or READ_FAILED."""
        self.handle(event)
        return self._settle()

    def _settle(self) -> ConsumerState:
        if self.state in _DRAINING:
            self.ranks.abandon_unregistered()
            if self.mode is TransferMode.PUSH and self.ranks.all_ended:
                self.handle(_CE.ENDED_ALL)
        elif self.state is _CS.WAITING and self.ranks.all_done:
            self.handle(_CE.DONE_ALL)
        return self.state


# --- producer registration (P, one per request and D rank) ------------------------------------------


class ProducerState(enum.Enum):
    PREFILLING = "prefilling"
    REGISTERED = "registered"  # push_reg before prefill end
    FINISHED_WAITING_REG = "finished_waiting_reg"  # prefill end before push_reg
    CONNECTING = "connecting"  # full handshake with D, mapping, posting; no write in flight yet
    WRITING = "writing"  # writes posted (done attached to the last)
    CANCEL_PENDING = "cancel_pending"  # cancel received while writes are in flight
    DONE_SENT = "done_sent"
    CANCELLED = "cancelled"  # cancel_ack sent
    FAILED = "failed"  # failed sent (when D is known)
    FREED = "freed"  # P's blocks freed


class ProducerTrigger(enum.Enum):
    PUSH_REG = "push_reg"
    PREFILL_DONE = "prefill_done"
    WRITES_POSTED = "writes_posted"
    WRITES_COMPLETE = "writes_complete"  # every handle DONE (the done notification went with the last)
    WRITE_FAILED = "write_failed"  # posting refused, or a handle failed; every handle finished or released
    HANDSHAKE_FAILED = "handshake_failed"
    FENCE_EXPIRED = "fence_expired"  # no write started within fence_ms of receiving push_reg
    LEASE_EXPIRED = "lease_expired"  # D stopped extending the lease on these blocks
    PEER_DEAD = "peer_dead"
    CANCEL = "cancel"
    ABORT = "abort"  # the request was aborted on P's side
    RELEASE = "release"


_PS, _PE = ProducerState, ProducerTrigger
# Ways to fail while nothing is in flight, shared by every pre-write state.
_PRE_WRITE_FAILS = [(_PE.LEASE_EXPIRED, _PS.FAILED), (_PE.ABORT, _PS.FAILED)]
PRODUCER_TABLE: TransitionTable[ProducerState, ProducerTrigger] = TransitionTable(
    role="producer",
    states=ProducerState,
    events=ProducerTrigger,
    initial=_PS.PREFILLING,
    terminal=frozenset({_PS.FREED}),
    transitions=_table(
        [
            (
                _PS.PREFILLING,
                [
                    (_PE.PUSH_REG, _PS.REGISTERED),
                    (_PE.PREFILL_DONE, _PS.FINISHED_WAITING_REG),
                    (_PE.ABORT, _PS.FAILED),
                ],
            ),
            (
                _PS.REGISTERED,
                [
                    (_PE.PREFILL_DONE, _PS.CONNECTING),
                    (_PE.CANCEL, _PS.CANCELLED),
                    # The handshake with D runs during the prefill: its failure ends the registration
                    # at once (and D is told), not when the prefill ends or the fence expires.
                    (_PE.HANDSHAKE_FAILED, _PS.FAILED),
                    (_PE.FENCE_EXPIRED, _PS.FAILED),
                    (_PE.PEER_DEAD, _PS.FAILED),
                    *_PRE_WRITE_FAILS,
                ],
            ),
            (
                _PS.FINISHED_WAITING_REG,
                [(_PE.PUSH_REG, _PS.CONNECTING), (_PE.CANCEL, _PS.CANCELLED), *_PRE_WRITE_FAILS],
            ),
            (
                _PS.CONNECTING,
                [
                    (_PE.WRITES_POSTED, _PS.WRITING),
                    (_PE.WRITE_FAILED, _PS.FAILED),
                    (_PE.HANDSHAKE_FAILED, _PS.FAILED),
                    (_PE.FENCE_EXPIRED, _PS.FAILED),
                    (_PE.PEER_DEAD, _PS.FAILED),
                    (_PE.CANCEL, _PS.CANCELLED),
                    *_PRE_WRITE_FAILS,
                ],
            ),
            # Writes in flight cannot be recalled: only their completion (or failure) leaves WRITING.
            (
                _PS.WRITING,
                [
                    (_PE.WRITES_COMPLETE, _PS.DONE_SENT),
                    (_PE.WRITE_FAILED, _PS.FAILED),
                    (_PE.CANCEL, _PS.CANCEL_PENDING),
                ],
            ),
            # The done went with the last write: a write that completes after a cancel delivered it, so
            # the registration ended DONE_SENT (D counts that done; a cancel_ack too would be a second end).
            (
                _PS.CANCEL_PENDING,
                [
                    (_PE.WRITES_COMPLETE, _PS.DONE_SENT),
                    (_PE.WRITE_FAILED, _PS.CANCELLED),
                    (_PE.CANCEL, _PS.CANCEL_PENDING),
                ],
            ),
            # A cancel that crossed our done: D counts the done, so no cancel_ack follows.
            (_PS.DONE_SENT, [(_PE.RELEASE, _PS.FREED), (_PE.CANCEL, _PS.DONE_SENT)]),
            (_PS.CANCELLED, [(_PE.RELEASE, _PS.FREED)]),
            (_PS.FAILED, [(_PE.RELEASE, _PS.FREED)]),
        ]
    ),
)

FAIL_REASONS: dict[ProducerTrigger, FailReason] = {
    _PE.WRITE_FAILED: FailReason.WRITE_FAILED,
    _PE.HANDSHAKE_FAILED: FailReason.HANDSHAKE_FAILED,
    _PE.FENCE_EXPIRED: FailReason.FENCE_EXPIRED,
    _PE.LEASE_EXPIRED: FailReason.LEASE_EXPIRED,
    _PE.PEER_DEAD: FailReason.PEER_DEAD,
    _PE.ABORT: FailReason.ABORTED,
}


class ProducerRegistration(_Machine[ProducerState, ProducerTrigger]):
    def __init__(self, state: ProducerState | None = None) -> None:
        super().__init__(PRODUCER_TABLE, state)

    @property
    def registration_ended(self) -> bool:
        """The one ending message (done, cancel_ack or failed) is out: D may count this rank as ended."""
        return self._state in _REG_ENDED  # a tuple: members compare by identity, no Enum.__hash__

    @property
    def writes_in_flight(self) -> bool:
        return self._state in _WRITES_IN_FLIGHT


# Asked of every registration at every settle and timer pass: built once, not per call.
_REG_ENDED = (_PS.DONE_SENT, _PS.CANCELLED, _PS.FAILED, _PS.FREED)
_WRITES_IN_FLIGHT = (_PS.WRITING, _PS.CANCEL_PENDING)


ALL_TABLES: tuple[TransitionTable[Any, Any], ...] = (
    HANDSHAKE_TABLE,
    *CONSUMER_TABLES.values(),
    PRODUCER_TABLE,
)
