"""The producer's registration bookkeeping: request and registration records, their checks, P's replies.

Everything here is plain data and pure functions over it; the producer cores drive the flow
(notifications, handshakes, writes, timers) and call these. Nothing here touches an agent.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import msgspec

from kvwire.core.events import ProducerOutcome
from kvwire.core.types import EngineInfo, PeerRank
from kvwire.errors import BlockRangeError, LayoutError
from kvwire.kv.mapping import tp_contacts, tp_peers
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import (
    CancelAck,
    Failed,
    FailReason,
    Heartbeat,
    Notification,
    PushReg,
    id_batches,
)
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ProducerRegistration, ProducerState


class Phase(enum.Enum):
    """The request's hold on P's blocks."""

    PREFILLING = "prefilling"  # registrations may arrive; no blocks held yet
    HELD = "held"  # prefill finished: the connector holds the blocks
    ENDED = "ended"  # freeable event emitted (or never held); kept as a tombstone


@dataclass(eq=False, slots=True)
class Reg:
    """One ``push_reg``: from one D rank (agent ``sender``) to one local rank ``key``."""

    key: RankKey
    sender: str
    msg: PushReg
    fence_at: float
    received_at: float = 0.0  # when the push_reg came: D's liveness is counted from here at the latest
    machine: ProducerRegistration = field(default_factory=ProducerRegistration)
    peer: PeerRank | None = None
    handshake_failed: bool = False
    token: int = 0  # the write in flight (0: none)
    posting: bool = False  # a PostWrite / done Send awaits its Outcome
    posted_at: float = 0.0
    wrote: bool = False
    outbox: list[Notification] = field(default_factory=list)  # to send once D is loaded

    @property
    def state(self) -> ProducerState:
        return self.machine.state


@dataclass(eq=False, slots=True)
class Request:
    transfer_id: str
    phase: Phase = Phase.PREFILLING
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    lease_until: float = math.inf
    regs: dict[tuple[RankKey, str], Reg] = field(default_factory=dict)
    d_tp_size: int | None = None
    d_idle: bool | None = None  # D tells the P ranks it reads nothing from (``PushReg.idle_ranks``)
    d_owner: tuple[str, str] | None = None  # the D life whose registrations passed ``check_reg``
    aborted: bool = False
    outcome: ProducerOutcome | None = None
    # (local rank, D agent) pairs whose cancel came before their push_reg: that push_reg is refused.
    cancelled: set[tuple[RankKey, str]] = field(default_factory=set)
    # The D lives (engine_id, incarnation) whose cancel came without a registration: D gave it up.
    gave_up: set[tuple[str, str]] = field(default_factory=set)
    forget_at: float = math.inf
    # The D life (engine_id, incarnation) whose push_reg created it while P was prefilling: its share of
    # the early-registration table (None: created by the engine's own call).
    early_owner: tuple[str, str] | None = None
    early_ids: int = 0  # D's block ids its registrations name while PREFILLING (``max_early_block_ids``)
    # The D life whose cancel created it while P was prefilling (it ends at once): counted against that
    # life's ``max_early_registrations_per_peer`` until the tombstone is forgotten.
    cancel_owner: tuple[str, str] | None = None
    # Pull: the D life whose ranks claimed it (one reads a request), and its TP ranks, each True from
    # its granted ``claim`` until it said ``done`` or ``failed`` (to any P rank: D says it to every one it
    # read from once all its reads ended), False once it did (a rank that read nothing says it unclaimed).
    # The blocks stay held until every D rank that reads ours ended (``d_tp_size`` names them), or the
    # lease runs out. And whether one of them failed.
    claim_life: tuple[str, str] | None = None
    claims: dict[int, bool] = field(default_factory=dict)  # by D TP rank
    claim_failed: bool = False
    claim_broke: bool = False  # ... with another reason than ``aborted`` (then FAILED, else ABORTED)


def drop_d_ids(reg: Reg) -> int:
    """Forget the block ids of D a registration named once no write of it can start or is in flight: an
    ended one (a tombstone's, a failed one's) needs none, and a 4 MiB push_reg names ~800k of them.
    Returns how many were forgotten."""
    n = len(reg.msg.block_ids)
    if not n or reg.machine.writes_in_flight or reg.posting:
        return 0
    reg.msg = msgspec.structs.replace(reg.msg, block_ids=[])
    return n


def records_of(req: Request) -> int:
    """What a request holds of a peer's making: its registrations and remembered cancels."""
    return len(req.regs) + len(req.cancelled)


def busy(req: Request) -> bool:
    """A write of the request is in flight or being posted: it must end before the request is forgotten."""
    return any(r.machine.writes_in_flight or r.posting for r in req.regs.values())


# Why a push_reg that arrives for an ended request is refused.
# ``expected_d_ranks`` of an engine's core: (D's tp size, local tp rank, D tells idle ranks) -> D ranks.
Expected = Callable[[int, int, bool], frozenset[int]]

TOMB_REASON = {
    ProducerOutcome.ABORTED: FailReason.ABORTED,
    ProducerOutcome.SHUTDOWN: FailReason.SHUTDOWN,
}


@lru_cache(maxsize=256)
def expected_d_ranks(spec: KVSpec, p_tp: int, d_tp: int, p_rank: int, idle: bool = True) -> frozenset[int]:
    """The D TP ranks that register with P rank ``p_rank``: those it writes, and, when no D rank reads it
    and D tells such ranks (``idle``: its ``push_reg``/``claim`` says so), the one that tells it the
    request's end (``tp_contacts``)."""
    if not 0 <= p_rank < p_tp:
        raise LayoutError(f"p_rank {p_rank} out of range for tp {p_tp}")
    if not idle:
        return frozenset(s.dst_rank for s in tp_peers(spec, p_tp, d_tp, p_rank))
    return frozenset(dst for src, dst in tp_contacts(spec, p_tp, d_tp) if src == p_rank)


def check_reg(req: Request, reg: Reg, expected: Expected) -> FailReason | None:
    """Whether a push_reg fits this rank and the request's other registrations (None: it does);
    ``expected(d_tp_size, local tp rank)``: ``expected_d_ranks`` of this engine."""
    msg = reg.msg
    if not msg.tp_rank < msg.tp_size or req.d_tp_size not in (None, msg.tp_size):
        return FailReason.BAD_REGISTRATION
    if req.d_idle not in (None, msg.idle_ranks):
        return FailReason.BAD_REGISTRATION
    try:
        want = expected(msg.tp_size, reg.key[1], msg.idle_ranks)
    except LayoutError:
        return FailReason.INCOMPATIBLE
    if msg.tp_rank not in want or msg.num_cached_tokens > msg.num_tokens:
        return FailReason.BAD_REGISTRATION
    req.d_tp_size, req.d_idle, req.d_owner = msg.tp_size, msg.idle_ranks, d_life(reg)
    return None


def check_d_blocks(block_ids: Iterable[int], num_blocks: int) -> None:
    """D's block ids against D's block count from the handshake (``BlockRangeError``): P never writes
    outside D's cache, and never twice into one block."""
    seen: set[int] = set()
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise BlockRangeError(f"D block id {b} outside [0, {num_blocks})")
        if b in seen:
            raise BlockRangeError(f"D block id {b} listed twice")
        seen.add(b)


def all_ended(keys: Iterable[RankKey], req: Request, want: Expected) -> bool:
    """Every registration each local rank expects (``want(d_tp_size, local tp rank)``, from D's TP size)
    came and ended."""
    d_tp = req.d_tp_size
    if d_tp is None:
        return False
    regs = req.regs.values()
    for r in regs:
        if not r.machine.registration_ended:
            return False
    for key in keys:
        got = {r.msg.tp_rank for r in regs if r.key == key}
        if not want(d_tp, key[1], bool(req.d_idle)) <= got:
            return False
    return True


def registrations_ended(req: Request) -> bool:
    """No registration of ``req`` can write any more (none came, or each ended)."""
    return all(r.machine.registration_ended for r in req.regs.values())


def given_up(req: Request) -> bool:
    """A D gave ``req`` up (a ``cancel`` without a registration: it cancels only a request it failed,
    dropped or declined) and no registration can write: the D whose registrations it took, or any D
    while it took none (a cancel from another D life must not end one that D is still loading; a
    registration refused at once, say of another D, makes no D its owner)."""
    if not req.gave_up or not registrations_ended(req):
        return False
    return req.d_owner is None or req.d_owner in req.gave_up


def outcome(req: Request) -> ProducerOutcome:
    states = {r.state for r in req.regs.values()}
    if ProducerState.FAILED in states:
        return ProducerOutcome.FAILED
    if ProducerState.CANCELLED in states:
        return ProducerOutcome.ABORTED
    return ProducerOutcome.SENT


def live_registrations(requests: Mapping[str, Request]) -> dict[tuple[RankKey, str], list[str]]:
    """(local rank, D agent) -> transfer ids of the registrations we hold with a loaded D (heartbeats)."""
    live: dict[tuple[RankKey, str], list[str]] = defaultdict(list)
    for req in requests.values():
        if req.phase is Phase.ENDED:
            continue
        for reg in req.regs.values():
            if reg.peer is not None and not reg.machine.registration_ended:
                live[(reg.key, reg.sender)].append(req.transfer_id)
    return live


def engines_in_use(requests: Mapping[str, Request]) -> set[str]:
    """D engines that a registration still being served refers to (their agents must not be reaped)."""
    return {
        reg.msg.engine_id
        for req in requests.values()
        if req.phase is not Phase.ENDED
        for reg in req.regs.values()
        if not reg.machine.registration_ended or reg.machine.writes_in_flight
    }


DLife = tuple[str, str]  # (engine_id, incarnation) of a D engine


def d_life(reg: Reg) -> DLife:
    return (reg.msg.engine_id, reg.msg.incarnation)


def holding(reg: Reg) -> bool:
    """Whether P still holds something for D under this registration (an open registration or a write).
    A write in flight is never in an ended state, so this is ``not registration_ended``."""
    return not reg.machine.registration_ended


def waits(held: Sequence[tuple[Request, Reg]], now: float, limit: int = 4) -> str:
    """What each held registration was at, for the log line that declares its D dead: a silence with
    the prefill still running, a write stuck in flight or a handshake never answered calls for different
    fixes. At most ``limit`` named, then a count."""
    parts = []
    for req, reg in held[:limit]:
        state = reg.state.value
        if reg.machine.writes_in_flight:
            state += f", write in flight {now - reg.posted_at:.1f} s"
        handshake = "done" if reg.peer is not None else "not done"
        parts.append(f"{req.transfer_id} ({req.phase.value}; {state}; D handshake {handshake})")
    more = f" and {len(held) - limit} more" if len(held) > limit else ""
    return (", ".join(parts) or "nothing") + more


def silent_d_lives(
    requests: Mapping[str, Request], last_seen: Mapping[DLife, float], now: float, timeout_s: float
) -> set[DLife]:
    """D lives that P holds registrations or writes for and that said nothing for ``timeout_s``.

    Only loaded peers count: a registration whose handshake with D is still running is bounded by the
    handshake's own timeout (and the fence). Runs at every timer pass over every live registration, so the
    cheapest test goes first: ``now - max(seen, received) <= now - received``, so a registration received
    within the timeout is not silent whatever its life's last word."""
    silent: set[DLife] = set()
    for req in requests.values():
        for reg in req.regs.values():
            received = reg.received_at
            if not now - received > timeout_s or reg.peer is None or reg.machine.registration_ended:
                continue
            life = (reg.msg.engine_id, reg.msg.incarnation)
            if now - max(last_seen.get(life, received), received) > timeout_s:
                silent.add(life)
    return silent


# The states whose registration the fence ends (D may not write later than it said).
FENCED = (ProducerState.REGISTERED, ProducerState.CONNECTING)


def fence_expired(reg: Reg, now: float) -> bool:
    """The registration's fence passed before its write began. One waiting on its handshake or a post is
    left alone: that is bounded, and its answer applies the fence."""
    if not (now > reg.fence_at and reg.state in FENCED) or reg.posting:
        return False
    return not (reg.state is ProducerState.CONNECTING and reg.peer is None and not reg.handshake_failed)


def uncovered(req: Request, reg: Reg) -> FailReason | None:
    """Why the registration cannot take the prompt P prefilled (None: it can). Fewer tokens, or blocks
    that cannot hold them, would hand D a prefix as if it were the prompt (D would decode from a
    truncated context and answer 200): ``short_registration``; more tokens: ``bad_registration``."""
    msg, peer = reg.msg, reg.peer
    if msg.num_tokens > req.num_tokens or msg.num_tokens <= 0:
        return FailReason.BAD_REGISTRATION
    d_block = peer.layout.block_size if peer is not None and peer.layout is not None else 1
    if msg.num_tokens < req.num_tokens or len(msg.block_ids) * d_block < msg.num_tokens:
        return FailReason.SHORT_REGISTRATION
    return None


def sweep_due(requests: Mapping[str, Request], last_seen: Mapping[DLife, float], timeout_s: float) -> float:
    """The earliest time a timer pass can act on one of ``requests``: a fence, a lease, a D life's silence.

    Passes before it need not visit the requests (a live request costs nothing per pass); the core lowers
    it when a registration or a lease begins. A registration past its fence that waits on a handshake or
    a post keeps it in the past, so the passes go on visiting until that ends."""
    due = math.inf
    for req in requests.values():
        if req.phase is Phase.HELD:
            due = min(due, req.lease_until)
        for reg in req.regs.values():
            if reg.machine.state in FENCED:
                due = min(due, reg.fence_at)
            if not reg.machine.registration_ended:
                received = reg.received_at
                life = (reg.msg.engine_id, reg.msg.incarnation)
                due = min(due, max(last_seen.get(life, received), received) + timeout_s)
    return due


class Replies:
    """P's notifications to D, stamped with this engine's identity."""

    def __init__(self, engine: EngineInfo) -> None:
        self._engine_id = engine.engine_id
        self._incarnation = engine.incarnation

    def failed(self, transfer_id: str, key: RankKey, reason: FailReason) -> Failed:
        return Failed(
            transfer_id=transfer_id,
            engine_id=self._engine_id,
            incarnation=self._incarnation,
            tp_rank=key[1],
            pp_rank=key[0],
            reason=reason,
        )

    def cancel_ack(self, transfer_id: str, key: RankKey, wrote: bool) -> CancelAck:
        return CancelAck(
            transfer_id=transfer_id,
            engine_id=self._engine_id,
            incarnation=self._incarnation,
            tp_rank=key[1],
            pp_rank=key[0],
            wrote=wrote,
        )

    def heartbeats(self, transfer_ids: list[str]) -> list[Heartbeat]:
        """The heartbeats that carry ``transfer_ids`` (more than one past ``MAX_HEARTBEAT_IDS``)."""
        return [
            Heartbeat(
                transfer_id="", engine_id=self._engine_id, incarnation=self._incarnation, transfer_ids=part
            )
            for part in id_batches(transfer_ids)
        ]
