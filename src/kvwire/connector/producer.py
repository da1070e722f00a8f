"""The producer (P side): writes finished requests' KV into D's blocks (push), or lends it to D (pull).

Engine call sites (any thread; none waits on the network):

* ``start() -> port``: registers every local rank's cache with its agent, starts the side channel.
* ``request_finished(transfer_id, block_ids, num_tokens)``: prefill is over; the connector now holds the
  blocks (the same block ids on every local rank) until it reports them freeable.
* ``poll() -> list[ProducerEvent]``: exactly one event per ``request_finished``: its blocks may be freed.
* ``abort(transfer_id)``: the engine drops the request; no new write starts for it (writes in flight
  finish first, then the event comes).
* ``close()``.

Push, per (request, local rank, D rank) a ``ProducerRegistration`` machine: ``push_reg`` and the end of
prefill may come in either order. The full handshake with D starts as soon as the ``push_reg`` arrives
(it overlaps the prefill); when both are in, the request is mapped (``plan_transfer``: coalesced
descriptors, D's prefix hit trimmed) and ONE write is posted with ``done`` attached. Block ids are
checked against D's block count from the handshake (``failed``/``bad_registration``, no write). No
write starts more than ``fence_ms`` after the ``push_reg`` was received (``failed``/``fence_expired``);
a ``cancel`` is answered with ``cancel_ack`` only when no write of ours is in flight; a failed post or
write sends ``failed`` at once; a write in progress past ``transfer_timeout_s`` is released, then
reported failed. The request's blocks are freeable when every registration every local rank expects
(from D's TP size) has ended, or when the lease (``kv_lease_duration_s`` after prefill, extended by D's
heartbeats) runs out with no write in flight. An ended request is remembered ``tombstone_s`` so that a
late ``push_reg`` or ``cancel`` gets the right answer at once.

Pull: the blocks are held until D's ``done`` or ``failed`` (from any of D's ranks: D sends them only
once every one of its reads has finished), or the lease runs out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Sequence

from kvwire.connector._base import ConnectorBase, RankKey
from kvwire.connector._producer_state import (
    TOMB_REASON,
    Phase,
    Reg,
    Replies,
    Request,
    all_ended,
    check_d_blocks,
    check_reg,
    d_life,
    engines_in_use,
    holding,
    live_registrations,
    outcome,
    silent_d_lives,
)
from kvwire.connector.events import ProducerEvent, ProducerOutcome
from kvwire.errors import BlockRangeError, KvwireError, LayoutError, TransportError
from kvwire.handshake.types import PeerRank
from kvwire.kv.descriptors import plan_transfer
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import (
    Cancel,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    Notification,
    PushReg,
    TransferMode,
)
from kvwire.protocol.states import FAIL_REASONS, ProducerState
from kvwire.protocol.states import ProducerEvent as PE
from kvwire.transport.base import PeerMode, XferOp, XferStatus

log = logging.getLogger("kvwire.connector")


class Producer(ConnectorBase[ProducerEvent]):
    """P side of kvwire for one engine and all its local (pp, tp) ranks."""

    role = "producer"

    def _setup(self) -> None:
        self._requests: dict[str, Request] = {}  # live ones and tombstones
        # The timers walk only the live requests; tombstones wait in a queue ordered by forget_at (the
        # tombstone period is fixed), so a busy engine's thousands of ended requests cost nothing per tick.
        self._live: dict[str, Request] = {}
        self._early = 0  # live requests still PREFILLING (registered by D, not finished here yet)
        self._tombs: collections.deque[Request] = collections.deque()
        self._inflight: set[Reg] = set()
        self._layouts = {
            key: RankLayout.from_cache(rank.cache, pp_size=self.engine.pp_size, pp_rank=key[0])
            for key, rank in self.ranks.items()
        }
        self._next_heartbeat = 0.0
        self._replies = Replies(self.engine)
        # When each D life (engine_id, incarnation) last said anything: P watches D as D watches P, since
        # NIXL reports neither a frozen nor a partitioned D (a write to it just stays in progress).
        self._d_seen: dict[tuple[str, str], float] = {}
        self._last_tick = math.inf  # no pause before the first tick

    # -- engine call sites -----------------------------------------------------------------------------
    def request_finished(self, transfer_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        ids = [int(b) for b in block_ids]
        num_blocks = min(r.cache.num_blocks for r in self.ranks.values())
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad or len(set(ids)) != len(ids):
            raise BlockRangeError(f"{transfer_id}: bad or repeated local block ids {bad[:4] or ids[:8]}")
        self._call(self._finished, transfer_id, ids, int(num_tokens))

    def abort(self, transfer_id: str) -> None:
        self._call(self._abort, transfer_id)

    # -- request lifecycle (loop thread) ---------------------------------------------------------------
    def _request(self, transfer_id: str) -> Request:
        req = self._requests.get(transfer_id)
        if req is None:
            req = self._requests[transfer_id] = self._live[transfer_id] = Request(transfer_id)
            self._early += 1
        return req

    def _finished(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> None:
        now = self._clock()
        req = self._request(transfer_id)
        if req.phase is Phase.ENDED:  # aborted, or every registration already ended: nothing to send
            self._emit(ProducerEvent(transfer_id, req.outcome or ProducerOutcome.FAILED))
            return
        if req.phase is Phase.HELD:
            log.warning("producer: %s finished twice; ignored", transfer_id)
            return
        self._early -= 1  # PREFILLING -> HELD
        req.phase, req.block_ids, req.num_tokens = Phase.HELD, block_ids, num_tokens
        req.lease_until = now + self.config.kv_lease_duration_s
        for reg in list(req.regs.values()):
            self._fire(req, reg, PE.PREFILL_DONE)
            self._advance(req, reg, now)
        self._settle(req, now)

    def _abort(self, transfer_id: str) -> None:
        now = self._clock()
        req = self._request(transfer_id)
        if req.phase is Phase.ENDED:
            return
        req.aborted = True
        for reg in list(req.regs.values()):
            self._fail(req, reg, PE.ABORT)
        if req.phase is Phase.PREFILLING:
            self._end(req, ProducerOutcome.ABORTED, now, emit=False)
        self._settle(req, now)

    def _end(self, req: Request, how: ProducerOutcome, now: float, *, emit: bool) -> None:
        if req.phase is Phase.PREFILLING:
            self._early -= 1
        req.phase, req.outcome = Phase.ENDED, how
        req.forget_at = now + self.config.tombstone_s
        if self._live.pop(req.transfer_id, None) is req:
            self._tombs.append(req)
        for reg in req.regs.values():
            if reg.machine.accepts(PE.RELEASE):
                reg.machine.handle(PE.RELEASE)
        if emit:
            self._emit(ProducerEvent(req.transfer_id, how))

    def _settle(self, req: Request, now: float) -> None:
        """Emit the freeable event once nothing more can happen to a held request's blocks."""
        if req.phase is Phase.PREFILLING:
            if req.regs and all(r.machine.registration_ended for r in req.regs.values()):
                self._end(req, outcome(req), now, emit=False)
            return
        if req.phase is not Phase.HELD or any(r.machine.writes_in_flight for r in req.regs.values()):
            return
        if self.config.mode is TransferMode.PULL:
            return
        if req.aborted:
            self._end(req, ProducerOutcome.ABORTED, now, emit=True)
        elif all_ended(self.engine, self.ranks, req):
            self._end(req, outcome(req), now, emit=True)
        elif now >= req.lease_until:
            for reg in list(req.regs.values()):
                self._fail(req, reg, PE.LEASE_EXPIRED)
            self._end(req, ProducerOutcome.EXPIRED, now, emit=True)

    # -- registrations ---------------------------------------------------------------------------------
    def _fire(self, req: Request, reg: Reg, event: PE) -> bool:
        if not reg.machine.accepts(event):
            return False
        reg.machine.handle(event)
        return True

    def _on_push_reg(self, key: RankKey, sender: str, msg: PushReg, now: float) -> None:
        if self.config.mode is not TransferMode.PUSH:
            self._drop("unexpected", f"push_reg in {self.config.mode.value} mode")
            return
        if msg.transfer_id not in self._requests and self._early >= self.config.max_early_registrations:
            self._drop(
                "overload", f"push_reg {msg.transfer_id}: {self._early} registrations wait for prefill"
            )
            return
        req = self._request(msg.transfer_id)
        if (key, sender) in req.regs:
            self._drop("duplicate", f"push_reg {msg.transfer_id} from {sender}")
            return
        fence_s = min(msg.fence_ms, self.config.fence_ms) / 1000.0
        reg = req.regs[(key, sender)] = Reg(key, sender, msg, now + fence_s, received_at=now)
        reg.machine.handle(PE.PUSH_REG)
        bad = check_reg(self.engine, req, reg)
        if req.phase is Phase.ENDED:
            reason = TOMB_REASON.get(req.outcome or ProducerOutcome.EXPIRED, FailReason.LEASE_EXPIRED)
            reg.machine.handle(PE.ABORT if reason is FailReason.ABORTED else PE.LEASE_EXPIRED)
            reg.outbox.append(self._replies.failed(req.transfer_id, reg.key, reason))
        elif bad is not None:
            self._fail(req, reg, PE.ABORT, bad)
        elif req.phase is Phase.HELD:
            reg.machine.handle(PE.PREFILL_DONE)
        # Overlap the full handshake with D with the prefill: it is needed to write, and to tell D anything.
        self._handshake(
            key,
            msg.host,
            msg.port,
            (0, msg.tp_rank),
            PeerMode.FULL,
            lambda peer, exc: self._on_d_handshake(req, reg, peer, exc),
            engine_id=msg.engine_id,
            # A restarted D (same address, new life) must not be served from the old one's cache entry.
            incarnation=msg.incarnation,
        )

    def _on_d_handshake(
        self, req: Request, reg: Reg, peer: PeerRank | None, exc: BaseException | None
    ) -> None:
        now = self._clock()
        if peer is not None and (peer.incarnation != reg.msg.incarnation or peer.agent_name != reg.sender):
            exc = KvwireError(
                f"D at {reg.msg.host}:{reg.msg.port} is now {peer.agent_name}, not {reg.sender}"
            )
            peer = None
        if peer is None:
            log.info("producer: handshake with D for %s failed: %s", req.transfer_id, exc)
            reg.handshake_failed = True
            reg.outbox.clear()
            self._fail(req, reg, PE.HANDSHAKE_FAILED)
            self._settle(req, now)
            return
        reg.peer = peer
        for msg in reg.outbox:
            self._send(reg.key, reg.sender, msg)
        reg.outbox.clear()
        if not reg.machine.registration_ended:
            try:
                # Refuse a bad registration at once, not at write time: P writes only inside D's cache.
                check_d_blocks(reg.msg.block_ids, peer.num_blocks)
            except BlockRangeError as exc:
                log.info("producer: registration %s from %s refused: %s", req.transfer_id, reg.sender, exc)
                self._fail(req, reg, PE.ABORT, FailReason.BAD_REGISTRATION)
        self._advance(req, reg, now)
        self._settle(req, now)

    def _advance(self, req: Request, reg: Reg, now: float) -> None:
        """Start the write when the registration is connecting, D is loaded, and the fence allows."""
        if reg.state is not ProducerState.CONNECTING:
            return
        if reg.handshake_failed:
            self._fail(req, reg, PE.HANDSHAKE_FAILED)
        elif reg.peer is None:
            return  # the handshake's callback comes back here
        elif now > reg.fence_at:
            self._fail(req, reg, PE.FENCE_EXPIRED)
        else:
            self._write(req, reg, reg.peer, now)

    def _write(self, req: Request, reg: Reg, peer: PeerRank, now: float) -> None:
        msg = reg.msg
        rank = self.ranks[reg.key]
        if peer.layout is None or msg.num_tokens > req.num_tokens or msg.num_tokens <= 0:
            self._fail(req, reg, PE.WRITE_FAILED, FailReason.BAD_REGISTRATION)
            return
        try:
            plan = plan_transfer(
                self.engine.spec,
                self._layouts[reg.key],
                peer.layout,
                req.block_ids,
                msg.block_ids,
                num_tokens=msg.num_tokens,
                num_cached_tokens=msg.num_cached_tokens,
            )
        except (BlockRangeError, LayoutError) as exc:
            log.info("producer: registration %s from %s refused: %s", req.transfer_id, reg.sender, exc)
            self._fail(req, reg, PE.WRITE_FAILED, FailReason.BAD_REGISTRATION)
            return
        done = Done(
            transfer_id=req.transfer_id,
            engine_id=self.engine.engine_id,
            incarnation=self.engine.incarnation,
            tp_rank=reg.key[1],
            pp_rank=reg.key[0],
            num_blocks=len(msg.block_ids) - msg.num_cached_tokens // peer.layout.block_size,
        )
        if plan.empty:  # D's prefix hit covers all, or this rank holds nothing D needs: just say so
            reg.machine.handle(PE.WRITES_POSTED)
            ok = self._send(reg.key, reg.sender, done)
            self._fire(req, reg, PE.WRITES_COMPLETE if ok else PE.WRITE_FAILED)
            return
        try:
            # The plan's [n, 3] arrays go to the transport as they are: no Desc object per descriptor.
            reg.handle = rank.agent.post_array(
                XferOp.WRITE,
                plan.src_array,
                plan.dst_array,
                peer.agent_name,
                notif=encode_notif(done),
                kind=rank.cache.mem_kind,
            )
        except TransportError as exc:
            log.info("producer: posting %s to %s failed: %s", req.transfer_id, peer.agent_name, exc)
            self._fail(req, reg, PE.WRITE_FAILED, FailReason.POST_FAILED)
            return
        reg.posted_at = now
        reg.machine.handle(PE.WRITES_POSTED)
        self._inflight.add(reg)
        self._wake()  # poll it at the busy rate from now on
        self.stats.transfers_started += 1
        self.stats.descriptors_posted += plan.num_descs

    def _fail(self, req: Request, reg: Reg, event: PE, reason: FailReason | None = None) -> None:
        """End a registration in FAILED (if ``event`` applies now) and tell D, now or once D is loaded."""
        if not reg.machine.accepts(event):
            return
        reg.machine.handle(event)
        reason = reason or FAIL_REASONS[event]
        self.stats.failures[reason] += 1
        failed = self._replies.failed(req.transfer_id, reg.key, reason)
        if reg.peer is not None:
            self._send(reg.key, reg.sender, failed)
        elif not reg.handshake_failed:
            reg.outbox.append(failed)

    def _cancel_ack(self, req: Request, reg: Reg, wrote: bool) -> None:
        ack = self._replies.cancel_ack(req.transfer_id, reg.key, wrote)
        if reg.peer is not None:
            self._send(reg.key, reg.sender, ack)
        elif not reg.handshake_failed:
            reg.outbox.append(ack)

    def _on_cancel(self, key: RankKey, sender: str, msg: Cancel, now: float) -> None:
        req = self._requests.get(msg.transfer_id)
        reg = None if req is None else req.regs.get((key, sender))
        if req is None or reg is None:
            # No registration from that D rank (lost, or long forgotten): nothing of ours can write.
            if self.ranks[key].agent.peer_mode(sender) is None:
                self._drop("unknown_transfer", f"cancel {msg.transfer_id} from {sender}")
            else:
                self._send(key, sender, self._replies.cancel_ack(msg.transfer_id, key, wrote=False))
            return
        self.stats.cancels += 1
        if reg.state is ProducerState.DONE_SENT:
            reg.machine.handle(PE.CANCEL)  # D counts our done: no cancel_ack
            return
        if not reg.machine.accepts(PE.CANCEL):
            self._drop("late", f"cancel {msg.transfer_id} in {reg.state.name}")
            return
        reg.machine.handle(PE.CANCEL)
        if reg.state is ProducerState.CANCELLED:
            self._cancel_ack(req, reg, wrote=False)
        self._settle(req, now)

    # -- notifications, transfers, timers (loop thread) ------------------------------------------------
    def _on_notif(self, key: RankKey, sender: str, msg: Notification, now: float) -> None:
        self._d_seen[(msg.engine_id, msg.incarnation)] = now  # the sender was checked against these
        if isinstance(msg, PushReg):
            self._on_push_reg(key, sender, msg, now)
        elif isinstance(msg, Cancel):
            self._on_cancel(key, sender, msg, now)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg, now)
        elif isinstance(msg, Done | Failed) and self.config.mode is TransferMode.PULL:
            self._on_pull_end(msg, now)
        else:
            self._drop("unexpected", f"{type(msg).__name__} from {sender}")

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        self._touch_peer(msg.engine_id)
        unknown = 0
        for tid in msg.transfer_ids:
            req = self._requests.get(tid)
            if req is None:
                unknown += 1
            elif req.phase is Phase.HELD:
                req.lease_until = max(req.lease_until, now + self.config.kv_lease_duration_s)
        if unknown:  # a peer naming transfers P does not hold: counted, never stored
            self.stats.dropped_notifs["heartbeat_unknown_ids"] += unknown

    def _on_pull_end(self, msg: Done | Failed, now: float) -> None:
        req = self._requests.get(msg.transfer_id)
        if req is not None and req.phase is Phase.ENDED:
            return  # D tells every P rank it read from; the first one ended the request
        if req is None or req.phase is not Phase.HELD:
            self._drop("unknown_transfer", f"{type(msg).__name__} {msg.transfer_id}")
            return
        if isinstance(msg, Failed):
            self.stats.failures[msg.reason] += 1
        else:
            self.stats.transfers_done += 1
        self._end(
            req, ProducerOutcome.PULLED if isinstance(msg, Done) else ProducerOutcome.FAILED, now, emit=True
        )

    def _busy(self) -> bool:
        return bool(self._inflight)

    def _poll_transfers(self, now: float) -> None:
        for reg in list(self._inflight):
            handle = reg.handle
            assert handle is not None
            polled = self._poll_xfer(reg.key, handle, reg.posted_at, now)
            if polled is None:
                continue
            state, timed_out = polled
            self._inflight.discard(reg)
            reg.handle = None
            req = self._requests[reg.msg.transfer_id]
            if state is XferStatus.DONE:
                reg.wrote = True
                self.stats.transfers_done += 1
                cancelled = reg.state is ProducerState.CANCEL_PENDING
                reg.machine.handle(PE.WRITES_COMPLETE)
                if cancelled:
                    self._cancel_ack(req, reg, wrote=True)
            else:
                reason = FailReason.TRANSFER_TIMEOUT if timed_out else FailReason.WRITE_FAILED
                if reg.state is ProducerState.CANCEL_PENDING:
                    reg.machine.handle(PE.WRITE_FAILED)
                    self._cancel_ack(req, reg, wrote=True)  # it may have landed in part
                else:
                    self._fail(req, reg, PE.WRITE_FAILED, reason)
                if reg.peer is not None and isinstance(handle.failed_reason, str) and not timed_out:
                    log.info(
                        "producer: write %s to %s failed: %s",
                        req.transfer_id,
                        reg.sender,
                        handle.failed_reason,
                    )
            self._settle(req, now)

    def _timers(self, now: float) -> None:
        self._forget_tombstones(now)
        for life in silent_d_lives(self._live, self._d_seen, now, self.config.liveness_timeout_s):
            self._d_dead(life, now)
        for req in list(self._live.values()):
            for reg in list(req.regs.values()):
                if reg.state in (ProducerState.REGISTERED, ProducerState.CONNECTING) and now > reg.fence_at:
                    if (
                        reg.state is ProducerState.CONNECTING
                        and reg.peer is None
                        and not reg.handshake_failed
                    ):
                        continue  # the handshake is bounded; its callback applies the fence
                    self._fail(req, reg, PE.FENCE_EXPIRED)
            pull = self.config.mode is TransferMode.PULL
            if pull and req.phase is Phase.HELD and now >= req.lease_until:
                self._end(req, ProducerOutcome.EXPIRED, now, emit=True)
                continue
            self._settle(req, now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._heartbeats()
            self._reap(engines_in_use(self._live))
            held = {d_life(reg) for req in self._live.values() for reg in req.regs.values() if holding(reg)}
            for life in [k for k in self._d_seen if k not in held]:
                del self._d_seen[life]

    def _d_dead(self, life: tuple[str, str], now: float) -> None:
        """D is silent past the liveness timeout: end everything P holds for it, then unload it.

        A write in flight cannot be recalled, only released (which cancels it); its source blocks stay
        quarantined until then, so the request's blocks become freeable only after the release."""
        log.warning(
            "producer: D %s/%s silent for %.1f s: declared dead",
            life[0],
            life[1],
            now - self._d_seen.get(life, now),
        )
        self.stats.peers_declared_dead += 1
        touched: list[Request] = []
        for req in list(self._live.values()):
            for reg in list(req.regs.values()):
                if d_life(reg) != life or not holding(reg):
                    continue
                touched.append(req)
                if reg.handle is None:
                    self._fail(req, reg, PE.PEER_DEAD)
                else:
                    self._recall(req, reg, FailReason.PEER_DEAD)
        self._forget_peer(*life)
        self._d_seen.pop(life, None)
        for req in touched:
            self._settle(req, now)

    def _recall(self, req: Request, reg: Reg, reason: FailReason) -> None:
        """Release a write in flight (NIXL cancels it) and end its registration: ``failed``, or
        ``cancel_ack`` (wrote: part of it may have landed) when D had cancelled."""
        assert reg.handle is not None
        with contextlib.suppress(TransportError):
            self.ranks[reg.key].agent.release(reg.handle)
        self._inflight.discard(reg)
        reg.handle = None
        if reg.state is ProducerState.CANCEL_PENDING:
            reg.machine.handle(PE.WRITE_FAILED)
            self._cancel_ack(req, reg, wrote=True)
        else:
            self._fail(req, reg, PE.WRITE_FAILED, reason)

    def _tick(self, now: float) -> None:
        # A P that was frozen (SIGSTOP, a long pause) resumes its posted writes at its first progress
        # call, and D may have declared it dead and reused their blocks meanwhile: past the point where
        # D may have (silent for its liveness timeout), recall every write before anything progresses.
        paused = now - self._last_tick
        self._last_tick = now
        cfg = self.config
        if self._inflight and paused > cfg.liveness_timeout_s - cfg.heartbeat_interval_s:
            log.warning("producer: paused %.2f s with writes in flight: recalling them", paused)
            for reg in list(self._inflight):
                req = self._requests[reg.msg.transfer_id]
                self._recall(req, reg, FailReason.TRANSFER_TIMEOUT)
                self._settle(req, now)
        super()._tick(now)

    def _forget_tombstones(self, now: float) -> None:
        tombs = self._tombs
        while tombs and tombs[0].forget_at <= now:
            req = tombs.popleft()
            if any(r.machine.writes_in_flight for r in req.regs.values()):
                req.forget_at = now + self.config.tombstone_s  # a write must end before we forget it
                tombs.append(req)
            elif self._requests.get(req.transfer_id) is req:
                del self._requests[req.transfer_id]

    def _heartbeats(self) -> None:
        """Tell each D agent which of its registrations we still hold (a long prefill is alive)."""
        for (key, sender), tids in live_registrations(self._live).items():
            if self._send(key, sender, self._replies.heartbeat(tids)):
                self.stats.heartbeats_sent += 1

    def _on_shutdown(self) -> None:
        now = self._clock()
        for req in list(self._requests.values()):
            for reg in list(req.regs.values()):
                if not reg.machine.registration_ended and reg.peer is not None:
                    failed = self._replies.failed(req.transfer_id, reg.key, FailReason.SHUTDOWN)
                    self._send(reg.key, reg.sender, failed)
            if req.phase is Phase.HELD:
                self._end(req, ProducerOutcome.SHUTDOWN, now, emit=True)
