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
from kvwire.core.io import Abort, Finished, Input, ReportFailure, TouchPeer
from kvwire.core.producer_records import Phase, Replies, Request, drop_d_ids, expected_d_ranks
from kvwire.errors import BlockRangeError, IllegalTransition
from kvwire.kv.groups import moved_ids
from kvwire.protocol.messages import Done, Failed, FailReason, Heartbeat, Notification, PushReg
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
        self._regs_total = 0  # registrations in the table, tombstones' included (``max_registrations``)
        self._early_by_life: collections.Counter[tuple[str, str]] = collections.Counter()  # their owners
        self._tombs: collections.deque[Request] = collections.deque()
        self._replies = Replies(self.engine)
        self._want: dict[tuple[int, int], frozenset[int]] = {}  # (D's tp size, local tp rank) -> D ranks

    def _expected(self, d_tp_size: int, tp_rank: int) -> frozenset[int]:
        """The D TP ranks local rank ``tp_rank`` writes (``expected_d_ranks``, memoized per core: asked at
        every settle, and the shared cache hashes the whole ``KVSpec`` per call)."""
        want = self._want.get((d_tp_size, tp_rank))
        if want is None:
            spec, tp = self.engine.spec, self.engine.tp_size
            want = self._want[(d_tp_size, tp_rank)] = expected_d_ranks(spec, tp, d_tp_size, tp_rank)
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
    def registrations_total(self) -> int:
        """Registrations in the table, tombstones' included (``max_registrations``)."""
        return self._regs_total

    def transfer_ids(self) -> list[str]:
        """The transfers P remembers: live ones and tombstones."""
        return list(self._requests)

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
        if known is not None and len(known.regs) >= cfg.max_registrations_per_request:
            return False
        if self._regs_total >= cfg.max_registrations:
            self._forget_oldest()
            if self._regs_total >= cfg.max_registrations:
                return False
        if known is None and (
            self._early >= cfg.max_early_registrations
            or self._early_by_life[life] >= cfg.max_early_registrations_per_peer
        ):
            return False
        early = known is None or known.phase is Phase.PREFILLING
        return not early or self._early_ids + len(msg.block_ids) + 1 <= cfg.max_early_block_ids

    def _overloaded(self, key: RankKey, sender: str, msg: PushReg) -> None:
        """Drop a push_reg the table has no room for (``_admit``; counted ``overload``), and tell D on its
        side channel: P holds nothing of it, and D would otherwise wait for its liveness timeout and call a
        busy P dead. The driver's Reporter sends it only with a secret (else the address is
        unauthenticated), one at a time per address."""
        self.stats.dropped_notifs[DropReason.OVERLOAD.value] += 1
        core_log().debug("%s: push_reg %s from %s dropped: %d registrations, %d wait for prefill",
                         self.role, msg.transfer_id, sender, self._regs_total, self._early)  # fmt: skip
        self._report(key, msg, self._replies.failed(msg.transfer_id, key, FailReason.OVERLOADED))

    def _report(self, key: RankKey, msg: PushReg, failed: Failed) -> None:
        self._do(ReportFailure(key, msg.host, msg.port, (0, msg.tp_rank), failed, msg.incarnation))

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
            if len(self._tombs) > self.config.max_tombstones:
                self._forget_oldest()
        for reg in req.regs.values():
            if reg.machine.accepts(PT.RELEASE):
                reg.machine.handle(PT.RELEASE)
            drop_d_ids(reg)
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
            if any(r.machine.writes_in_flight or r.posting for r in req.regs.values()):
                req.forget_at = now + self.config.tombstone_s  # a write must end before we forget it
                tombs.append(req)
            elif self._requests.get(req.transfer_id) is req:
                self._forget(req)

    def _forget(self, req: Request) -> None:
        del self._requests[req.transfer_id]
        self._regs_total -= len(req.regs)

    def _forget_oldest(self) -> None:
        """Past ``max_tombstones``, forget the oldest ended requests now (a push_reg naming one later waits
        for a Finished that never comes, and is answered at its fence instead of at once)."""
        tombs = self._tombs
        for _ in range(len(tombs)):
            if len(tombs) <= self.config.max_tombstones and self._regs_total < self.config.max_registrations:
                return
            req = tombs.popleft()
            if any(r.machine.writes_in_flight or r.posting for r in req.regs.values()):
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
    """Pull: P lends its blocks; D reads them and says ``done`` (or ``failed``) when every read ended."""

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
        if isinstance(msg, Failed):
            self.stats.failures[msg.reason] += 1
        else:
            self.stats.transfers_done += 1
        how = ProducerOutcome.PULLED if isinstance(msg, Done) else ProducerOutcome.FAILED
        self._end(now, req, how, emit=True)

    def _timers(self, now: float) -> None:
        for req in list(self._live_reqs.values()):
            if req.phase is Phase.HELD and now >= req.lease_until:
                self._end(now, req, ProducerOutcome.EXPIRED, emit=True)
