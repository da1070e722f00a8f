"""P's cores: what P does with its finished requests' blocks, as pure functions of ``(now, input)``.

``ProducerCore`` holds what both modes share: the request table (live requests and tombstones), the
engine's calls (``Finished``, ``Abort``), the lease that D's heartbeats extend, the one freeable event per
``Finished``. ``PullProducerCore`` adds pull's one rule: the blocks are held until D's ``done`` or
``failed`` (from any of D's ranks: D sends them once every read ended) or the lease runs out. Push is
``PushProducerCore`` (``producer_push.py``).
"""

from __future__ import annotations

import collections
import math

from kvwire.core.base import CoreBase, DropReason, core_log
from kvwire.core.events import ProducerEvent, ProducerOutcome
from kvwire.core.io import (
    Abort,
    AnswerClaim,
    ClaimArrived,
    Finished,
    Input,
    ReportFailure,
    TouchPeer,
)
from kvwire.core.producer_records import (
    Phase,
    Reg,
    Replies,
    Request,
    busy,
    drop_d_ids,
    expected_d_ranks,
    records_of,
)
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError
from kvwire.kv.groups import moved_ids
from kvwire.protocol.messages import (
    Cancel,
    Claim,
    Done,
    ErrorCode,
    Failed,
    FailReason,
    Heartbeat,
    Notification,
    PushReg,
)
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ProducerTrigger as PT


class ProducerCore(CoreBase):
    role = "producer"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._requests: dict[str, Request] = {}  # live ones and tombstones
        # The timers walk only the live requests; tombstones wait in a queue ordered by forget_at (the
        # tombstone period is fixed), so a busy engine's thousands of ended requests cost nothing per tick.
        self._live_reqs: dict[str, Request] = {}
        self._early = 0  # live requests still PREFILLING (registered by D, not finished here yet)
        self._early_ids = 0  # D's block ids their registrations name
        # Records a peer's messages add: registrations and remembered cancels, tombstones' included
        # (``max_registrations``); of those, the tombstones' (what forgetting them frees), and the
        # tombstones holding any, oldest first (entries of forgotten ones are skipped); D's block ids the
        # registrations hold (``max_block_ids``).
        self._records = 0
        # Per request: the setting per 8 ranks this core holds (a vLLM worker holds one): a core holding
        # every rank of a wide P (kvwire's engine at TP 64, PP 5: 320 ranks, a registration each from one
        # D rank) failed every request as overloaded under the setting alone.
        self._per_request = self.config.max_registrations_per_request * -(-len(self.layouts) // 8)
        self._tomb_records = 0
        self._record_tombs: collections.deque[Request] = collections.deque()
        self._ids = 0
        self._early_by_life: collections.Counter[tuple[str, str]] = collections.Counter()  # their owners
        self._early_cancels: collections.Counter[tuple[str, str]] = (
            collections.Counter()
        )  # Request.cancel_owner
        self._tombs: collections.deque[Request] = collections.deque()
        self._replies = Replies(self.engine)
        self._want: dict[tuple[int, int, bool], frozenset[int]] = {}  # _expected's memo

    def _expected(self, d_tp_size: int, tp_rank: int, idle: bool = True) -> frozenset[int]:
        """The D TP ranks that register with local rank ``tp_rank`` (``expected_d_ranks``, memoized per core:
        asked at every settle, and the shared cache hashes the whole ``KVSpec`` per call)."""
        want = self._want.get((d_tp_size, tp_rank, idle))
        if want is None:
            spec, tp = self.engine.spec, self.engine.tp_size
            want = expected_d_ranks(spec, tp, d_tp_size, tp_rank, idle)
            self._want[(d_tp_size, tp_rank, idle)] = want
        return want

    # -- introspection (tests, metrics) --------------------------------------------------------------------
    @property
    def live_requests(self) -> int:
        return len(self._live_reqs)

    @property
    def early_registrations(self) -> int:
        return self._early

    @property
    def early_block_ids(self) -> int:
        """D's block ids (+1 per registration) the early registrations name (``max_early_block_ids``)."""
        return self._early_ids

    @property
    def records(self) -> tuple[int, int, int]:
        """(registrations and remembered cancels, the tombstones' share, D's block ids held): what the
        table bounds read (``max_registrations``, ``max_block_ids``)."""
        return self._records, self._tomb_records, self._ids

    def recount(self) -> tuple[int, int, int]:
        """``records`` counted from the table itself (the simulator checks the two agree)."""
        reqs = self._requests.values()
        ended = [r for r in reqs if r.phase is Phase.ENDED]
        ids = sum(len(reg.msg.block_ids) for r in reqs for reg in r.regs.values())
        return sum(map(records_of, reqs)), sum(map(records_of, ended)), ids

    def registrations(self, transfer_id: str) -> int:
        """How many push_regs P holds for ``transfer_id`` (0 when unknown)."""
        req = self._requests.get(transfer_id)
        return 0 if req is None else len(req.regs)

    def _live(self) -> bool:
        return bool(self._live_reqs)

    def _idle_deadline(self) -> float:
        return self._tombs[0].forget_at if self._tombs else math.inf

    # -- engine inputs ---------------------------------------------------------------------------------------
    def _on_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, Finished):
            self._finished(now, inp)
        elif isinstance(inp, Abort):
            self._abort(now, inp.transfer_id)
        else:
            self._on_transfer_input(now, inp)

    def _on_transfer_input(self, now: float, inp: Input) -> None:
        raise IllegalTransition(self.role, "any", type(inp).__name__)

    def _request(self, transfer_id: str) -> Request:
        req = self._requests.get(transfer_id)
        if req is None:
            req = self._requests[transfer_id] = self._live_reqs[transfer_id] = Request(transfer_id)
            self._early += 1
        return req

    def _admit(self, known: Request | None, life: tuple[str, str], msg: PushReg) -> bool:
        """Whether a ``push_reg`` may add a registration: one request holds at most
        ``max_registrations_per_request``, the table ``max_registrations`` (the oldest tombstones make
        room first); the early ones (for requests not finished here) are bounded in number (in all, and
        per D life) and in the block ids they name."""
        cfg = self.config
        if self._no_room(known) or self._ids + len(msg.block_ids) > cfg.max_block_ids:
            return False
        if known is None and (
            self._early >= cfg.max_early_registrations
            or self._early_by_life[life] >= cfg.max_early_registrations_per_peer
        ):
            return False
        early = known is None or known.phase is Phase.PREFILLING
        return not early or self._early_ids + len(msg.block_ids) + 1 <= cfg.max_early_block_ids

    def _early_cancel(self, msg: Cancel | Failed) -> Request | None:
        """A record for a cancel of a transfer P has not seen (still prefilling here: a D that gave the
        request up, or declined it, before it registered), bounded as early registrations are; None
        when there is no room. The request then ends at once, and its prefill is reported ended when it
        finishes, not held to the lease."""
        life = (msg.engine_id, msg.incarnation)
        cfg = self.config
        if self._no_room(None) or self._early >= cfg.max_early_registrations:
            return None
        if self._early_cancels[life] >= cfg.max_early_registrations_per_peer:
            return None  # its tombstone outlives the early record: bounded per life until forgotten
        req = self._request(msg.transfer_id)
        req.early_owner = req.cancel_owner = life
        self._early_by_life[life] += 1
        self._early_cancels[life] += 1
        return req

    def _overloaded(self, key: RankKey, sender: str, msg: PushReg) -> None:
        """Drop a push_reg the table has no room for (``_admit``; counted ``overload``), and tell D on its
        side channel: P holds nothing of it, and D would otherwise wait for its liveness timeout and call a
        busy P dead. The driver's Reporter sends it only with a secret (else the address is
        unauthenticated), one at a time per address."""
        self.stats.dropped_notifs[DropReason.OVERLOAD.value] += 1
        core_log().debug("%s: push_reg %s from %s dropped: %d records, %d wait for prefill",
                         self.role, msg.transfer_id, sender, self._records, self._early)  # fmt: skip
        self._report(key, msg, self._replies.failed(msg.transfer_id, key, FailReason.OVERLOADED))

    def _report(self, key: RankKey, msg: PushReg, failed: Failed) -> None:
        self._do(ReportFailure(key, msg.host, msg.port, (0, msg.tp_rank), failed, msg.incarnation))

    def _add_record(self, req: Request, ids: int) -> None:
        """A registration (naming ``ids`` of D's blocks) or a remembered cancel joined ``req``."""
        self._records += 1
        self._ids += ids
        if req.phase is Phase.ENDED:
            self._tomb_records += 1
            self._record_tombs.append(req)

    def _records_full(self) -> bool:
        return self._records >= self.config.max_registrations

    def _no_room(self, req: Request | None) -> bool:
        """No record (a registration, a remembered cancel) may join ``req`` (None: a new request)."""
        full = req is not None and records_of(req) >= self._per_request
        return full or self._records_full()

    def _drop_ids(self, reg: Reg) -> None:
        self._ids -= drop_d_ids(reg)

    def _make_room(self) -> None:
        """At ``max_registrations``, forget the oldest tombstones holding records until there is room
        (called before a message looks its request up: it may forget that one). Nothing is forgotten when
        the live requests' records alone fill the table, nor tombstones that hold none."""
        cfg, tombs = self.config, self._record_tombs
        live = self._records - self._tomb_records
        if not self._records_full() or live >= cfg.max_registrations:
            return
        for _ in range(len(tombs)):
            if self._records < cfg.max_registrations:
                return
            req = tombs.popleft()
            if self._requests.get(req.transfer_id) is not req:
                continue  # forgotten already, or a second entry
            if busy(req):
                tombs.append(req)  # a write must end before we forget it
            else:
                self._forget(req)
                self.stats.tombstones_dropped += 1

    def _note_early(self, req: Request, msg: PushReg) -> None:
        if req.phase is Phase.PREFILLING:
            req.early_ids += len(msg.block_ids) + 1
            self._early_ids += len(msg.block_ids) + 1

    def _leave_early(self, req: Request) -> None:
        self._early -= 1
        self._early_ids -= req.early_ids
        req.early_ids = 0
        owner = req.early_owner
        if owner is not None:
            self._early_by_life[owner] -= 1
            if self._early_by_life[owner] <= 0:
                del self._early_by_life[owner]

    def _finished(self, now: float, inp: Finished) -> None:
        ids = list(inp.block_ids)
        used = moved_ids(self.engine.spec, ids, inp.num_tokens, 0)  # a hybrid model's: its groups' blocks
        if any(not 0 <= b < self.num_blocks for b in used) or len(set(used)) != len(used):
            raise BlockRangeError(f"{inp.transfer_id}: bad or repeated local block ids {ids[:8]}")
        req = self._requests.get(inp.transfer_id)
        if req is not None and req.phase is Phase.HELD:
            raise IllegalTransition(self.role, req.phase.name, "FINISHED")
        req = self._request(inp.transfer_id)
        if req.phase is Phase.ENDED:  # aborted, or every registration already ended: nothing to send
            self._emit(ProducerEvent(inp.transfer_id, req.outcome or ProducerOutcome.FAILED))
            return
        self._leave_early(req)  # PREFILLING -> HELD
        req.phase, req.block_ids, req.num_tokens = Phase.HELD, ids, inp.num_tokens
        req.lease_until = now + self.config.kv_lease_duration_s
        self._prefill_done(now, req)
        self._settle(now, req)

    def _prefill_done(self, now: float, req: Request) -> None:
        pass

    def _abort(self, now: float, transfer_id: str) -> None:
        req = self._request(transfer_id)
        if req.phase is Phase.ENDED:
            return
        req.aborted = True
        self._abort_regs(now, req)
        if req.phase is Phase.PREFILLING:
            self._end(now, req, ProducerOutcome.ABORTED, emit=False)
        self._settle(now, req)

    def _abort_regs(self, now: float, req: Request) -> None:
        pass

    def _end(self, now: float, req: Request, how: ProducerOutcome, *, emit: bool) -> None:
        if req.phase is Phase.PREFILLING:
            self._leave_early(req)
        req.phase, req.outcome = Phase.ENDED, how
        req.forget_at = now + self.config.tombstone_s
        if self._live_reqs.pop(req.transfer_id, None) is req:
            self._tombs.append(req)
            if records_of(req):
                self._tomb_records += records_of(req)
                self._record_tombs.append(req)
            if len(self._tombs) > self.config.max_tombstones:
                self._forget_oldest()
        for reg in req.regs.values():
            if reg.machine.accepts(PT.RELEASE):
                reg.machine.handle(PT.RELEASE)
            self._drop_ids(reg)
        if emit:
            self._emit(ProducerEvent(req.transfer_id, how))

    def _settle(self, now: float, req: Request) -> None:
        pass

    # -- peers -----------------------------------------------------------------------------------------------
    def _on_heartbeat(self, now: float, msg: Heartbeat) -> None:
        self._do(TouchPeer(msg.engine_id))
        unknown = 0
        for tid in msg.transfer_ids:
            req = self._requests.get(tid)
            if req is None:
                unknown += 1
            elif req.phase is Phase.HELD:
                req.lease_until = max(req.lease_until, now + self.config.kv_lease_duration_s)
        if unknown:  # a peer naming transfers P does not hold: counted, never stored
            self.stats.dropped_notifs["heartbeat_unknown_ids"] += unknown

    def _forget_tombstones(self, now: float) -> None:
        tombs = self._tombs
        while tombs and tombs[0].forget_at <= now:
            req = tombs.popleft()
            if busy(req):
                req.forget_at = now + self.config.tombstone_s  # a write must end before we forget it
                tombs.append(req)
            elif self._requests.get(req.transfer_id) is req:
                self._forget(req)
        held = self._record_tombs
        while held and self._requests.get(held[0].transfer_id) is not held[0]:
            held.popleft()  # forgotten: the queue keeps only what may still be forgotten early

    def _forget(self, req: Request) -> None:
        """Forget an ended request (a tombstone) and the records it held."""
        del self._requests[req.transfer_id]
        if (owner := req.cancel_owner) is not None:
            self._early_cancels[owner] -= 1
            if self._early_cancels[owner] <= 0:
                del self._early_cancels[owner]
        self._records -= records_of(req)
        self._tomb_records -= records_of(req)
        self._ids -= sum(len(reg.msg.block_ids) for reg in req.regs.values())

    def _forget_oldest(self) -> None:
        """Past ``max_tombstones``, forget the oldest ended requests now (a push_reg naming one later waits
        for a Finished that never comes, and is answered at its fence instead of at once)."""
        tombs = self._tombs
        for _ in range(len(tombs)):
            if len(tombs) <= self.config.max_tombstones:
                return
            req = tombs.popleft()
            if busy(req):
                tombs.append(req)  # a write must end before we forget it
            elif self._requests.get(req.transfer_id) is req:
                self._forget(req)
                self.stats.tombstones_dropped += 1

    def _on_tick(self, now: float) -> None:
        self._forget_tombstones(now)
        super()._on_tick(now)

    def _on_shutdown(self, now: float) -> None:
        for req in list(self._requests.values()):
            if req.phase is Phase.HELD:
                self._end(now, req, ProducerOutcome.SHUTDOWN, emit=True)


class PullProducerCore(ProducerCore):
    """Pull: P lends its blocks; each D rank claims them before it reads (``claim``: granted only while P
    holds them for that transfer) and says ``done`` (or ``failed``) when its reads ended; P holds them
    until every D rank that claimed them has, or the lease runs out."""

    def _on_transfer_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, ClaimArrived):
            self._claim(now, inp)
        else:
            super()._on_transfer_input(now, inp)

    def _claim(self, now: float, inp: ClaimArrived) -> None:
        msg = inp.msg
        req = self._requests.get(msg.transfer_id)
        code, detail = None, ""
        if req is None or req.phase is Phase.PREFILLING:
            code, detail = ErrorCode.NOT_YET, f"{msg.transfer_id}: not finished here (yet)"
        elif req.phase is not Phase.HELD:
            code, detail = ErrorCode.GONE, f"{msg.transfer_id}: no longer held here (expired or ended)"
        elif not set(msg.block_ids) <= set(req.block_ids):
            code, detail = ErrorCode.BAD_REQUEST, f"{msg.transfer_id}: names blocks not held for it"
        elif (problem := self._claimer_problem(req, msg)) is not None:
            code, detail = ErrorCode.BAD_REQUEST, f"{msg.transfer_id}: {problem}"
        else:
            req.claims.setdefault(msg.from_tp_rank, True)
            # At least the lease, and long enough for a read D does not time out itself (D takes a read
            # only if it ended within the grant, counted from when it sent the claim: its read's timeout
            # starts up to a claim's round trip later; D's heartbeats extend P's lease, but D cannot know).
            cfg = self.config
            grant = max(cfg.kv_lease_duration_s, cfg.transfer_timeout_s + cfg.handshake_timeout_s)
            req.lease_until = max(req.lease_until, now + grant)
            self._do(AnswerClaim(inp.token, grant))
            return
        self._do(AnswerClaim(inp.token, None, code, detail))

    def _claimer_problem(self, req: Request, msg: Claim) -> str | None:
        """Why this D rank may not claim ``req`` (None: it may). One D life reads a request, with one TP
        size, from the ranks that overlap ours (``expected_d_ranks``)."""
        life = (msg.engine_id, msg.incarnation)
        if req.claim_life not in (None, life) or req.d_tp_size not in (None, msg.tp_size):
            return "claimed by another D, or with another tp_size"
        if req.d_idle not in (None, msg.idle_ranks):
            return "claimed with another idle_ranks"
        if msg.from_pp_rank != 0 or not msg.from_tp_rank < msg.tp_size:
            return "a D rank out of range (D runs pp 1)"
        try:
            expected = self._d_readers(msg.tp_size, msg.idle_ranks)
        except LayoutError:
            return f"no D rank of tp_size {msg.tp_size} reads ours"
        if msg.from_tp_rank not in expected:
            return f"D rank tp{msg.from_tp_rank} reads nothing of ours"
        req.claim_life, req.d_tp_size, req.d_idle = life, msg.tp_size, msg.idle_ranks
        return None

    def _d_readers(self, d_tp_size: int, idle: bool) -> frozenset[int]:
        """The D TP ranks that read any of this core's ranks."""
        return frozenset().union(*(self._expected(d_tp_size, key[1], idle) for key in self.layouts))

    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(now, msg)
        elif isinstance(msg, Done | Failed):
            self._on_pull_end(now, msg)
        else:
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender} in pull mode")

    def _on_pull_end(self, now: float, msg: Done | Failed) -> None:
        req = self._requests.get(msg.transfer_id)
        if req is not None and req.phase is Phase.ENDED:
            return  # D tells every P rank it read from; the first one ended the request
        if req is None or req.phase is not Phase.HELD:
            raise self._refuse(DropReason.UNKNOWN_TRANSFER, f"{type(msg).__name__} {msg.transfer_id}")
        if req.claim_life not in (None, (msg.engine_id, msg.incarnation)):
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} {msg.transfer_id}: another D")
        rank = msg.tp_rank  # D runs pp 1
        reading = req.claims.get(rank)
        if reading is False:
            return  # its word to another of our ranks came first
        if (
            reading is None
            and req.d_tp_size is not None
            and msg.tp_rank not in self._d_readers(req.d_tp_size, bool(req.d_idle))
        ):
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} {msg.transfer_id}: not a reader")
        req.claims[rank] = False  # ended: claimed and read, or read nothing (its plan was empty)
        if isinstance(msg, Failed):
            req.claim_failed = True
            # ``aborted``: D gave the request up (dropped, declined): the same end as push's cancel.
            if msg.reason is not FailReason.ABORTED:
                self.stats.failures[msg.reason] += 1
                req.claim_broke = True
        if any(req.claims.values()):
            return  # a D rank still reads them
        if not req.claim_failed and not self._all_readers_ended(req):
            return  # a D rank has yet to claim them (a failed load ends here: a late claim finds them gone)
        if not req.claim_failed:
            self.stats.transfers_done += 1
        how = ProducerOutcome.PULLED
        if req.claim_failed:
            how = ProducerOutcome.FAILED if req.claim_broke else ProducerOutcome.ABORTED
        self._end(now, req, how, emit=True)

    def _all_readers_ended(self, req: Request) -> bool:
        """Every D rank that reads ours said ``done`` or ``failed`` (without any claim: D's first word)."""
        if req.d_tp_size is None:
            return True
        ended = {tp for tp, reading in req.claims.items() if not reading}
        return self._d_readers(req.d_tp_size, bool(req.d_idle)) <= ended

    def _timers(self, now: float) -> None:
        for req in list(self._live_reqs.values()):
            if req.phase is Phase.HELD and now >= req.lease_until:
                self.stats.failures[FailReason.LEASE_EXPIRED] += 1  # what operators watch for D not reading
                self._end(now, req, ProducerOutcome.EXPIRED, emit=True)
