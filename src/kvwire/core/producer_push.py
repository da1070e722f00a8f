"""P's push core: writes finished requests' KV into the blocks D registered, as pure ``(now, input)`` rules.

Per (request, local rank, D rank) a ``ProducerRegistration`` machine: ``push_reg`` and the end of prefill
may come in either order. The full handshake with D starts as soon as the ``push_reg`` arrives (it
overlaps the prefill); when both are in, the request is mapped (``plan_transfer``: coalesced descriptors,
D's prefix hit trimmed) and ONE write is posted with ``done`` attached. Block ids are checked against D's
block count from the handshake (``failed``/``bad_registration``, no write). No write starts more than
``fence_ms`` after the ``push_reg`` was received (``failed``/``fence_expired``); a ``cancel`` is answered
with ``cancel_ack`` only when no write of ours is in flight; a failed post or write sends ``failed`` at
once; a write in progress past ``transfer_timeout_s`` is released, then reported failed. Blocks are freed
when every registration each local rank expects has ended, when D gave the request up (a ``cancel`` with
no registration), or at the lease; an ended request is remembered ``tombstone_s`` (late messages).

P watches D as D watches P (NIXL reports neither a frozen nor a partitioned D: a write to it just stays
in progress): a D life silent past ``liveness_timeout_s`` while P holds something for it is dead. A P that
was itself frozen recalls every write in flight at its first tick (see ``_on_tick``).
"""

from __future__ import annotations

import math

import msgspec

from kvwire.core.base import DropReason
from kvwire.core.events import ProducerOutcome
from kvwire.core.io import (
    Digest,
    Digested,
    ForgetPeer,
    HandshakeDone,
    Input,
    Outcome,
    PostWrite,
    Reap,
    Release,
    StartHandshake,
    Tick,
    TouchPeer,
    XferEnded,
)
from kvwire.core.producer import ProducerCore
from kvwire.core.producer_records import (
    TOMB_REASON,
    DLife,
    Phase,
    Reg,
    Request,
    all_ended,
    check_d_blocks,
    check_reg,
    d_life,
    engines_in_use,
    fence_expired,
    given_up,
    holding,
    live_registrations,
    outcome,
    registrations_ended,
    silent_d_lives,
    sweep_due,
    uncovered,
    waits,
)
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError
from kvwire.kv.descriptors import TransferPlan, plan_transfer
from kvwire.kv.digest import DigestScope, common_layers, pair_heads, payload_bytes
from kvwire.kv.groups import moved_ids
from kvwire.kv.mapping import HeadSlice
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import Cancel, Done, Failed, FailReason, Heartbeat, Notification, PushReg
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import FAIL_REASONS, ProducerState
from kvwire.protocol.states import ProducerTrigger as PT
from kvwire.protocol.types import PeerMode


class PushProducerCore(ProducerCore):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._inflight: dict[int, Reg] = {}  # write token -> registration
        self._handshakes: dict[int, tuple[Request, Reg]] = {}
        self._awaiting: dict[int, tuple[Request, Reg, bool]] = {}  # token -> (req, reg, is the write)
        self._sizes: dict[int, int] = {}  # write token -> bytes
        self._digesting: dict[int, tuple[Request, Reg, TransferPlan, Done]] = {}  # Digest token
        # When each D life (engine_id, incarnation) last said anything.
        self._d_seen: dict[DLife, float] = {}
        self._last_input = math.inf  # no freeze before the first input
        self._stale_ticks = 0  # see _before
        self._pair_heads: dict[tuple[int, int, int], tuple[HeadSlice, ...]] = {}  # see _slices
        # The earliest time a timer pass may act (a fence, a lease, a D life's silence): passes before it
        # skip the sweep over every live request (sweep_due; lowered when a registration or lease begins).
        self._sweep_at = math.inf

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    # -- notifications ---------------------------------------------------------------------------------------
    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        if self._thawing:
            self._on_stale_notif(now, key, sender, msg)
            return
        life = (msg.engine_id, msg.incarnation)  # the sender was checked against these
        last, self._d_seen[life] = self._d_seen.get(life), now
        if not isinstance(msg, Heartbeat) and (last is None or now - last > self.config.heartbeat_interval_s):
            self._do(TouchPeer(msg.engine_id))  # its first word after a silence: a tripped circuit closes
        if isinstance(msg, PushReg):
            self._on_push_reg(now, key, sender, msg)
        elif isinstance(msg, Cancel | Failed):
            # A D that gives up says cancel; one that says failed gives up too (the contract lets D end a
            # registration either way), and is answered the same way.
            self._on_cancel(now, key, sender, msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(now, msg)
        else:
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender} in push mode")

    def _on_push_reg(
        self, now: float, key: RankKey, sender: str, msg: PushReg, *, stale: bool = False
    ) -> None:
        self._make_room()
        known = self._requests.get(msg.transfer_id)
        life = (msg.engine_id, msg.incarnation)
        cfg = self.config
        if known is not None and (key, sender) in known.regs:
            raise self._refuse(DropReason.DUPLICATE, f"push_reg {msg.transfer_id} from {sender}")
        if known is not None and (key, sender) in known.cancelled:
            raise self._refuse(DropReason.CANCELLED, f"push_reg {msg.transfer_id} after its cancel")
        if not self._admit(known, life, msg):
            self._overloaded(key, sender, msg)
            return
        req = self._request(msg.transfer_id)
        if known is None:
            req.early_owner = life
            self._early_by_life[life] += 1
        fence_s = min(msg.fence_ms, self.config.fence_ms) / 1000.0
        reg = req.regs[(key, sender)] = Reg(key, sender, msg, now + fence_s, received_at=now)
        self._add_record(req, len(msg.block_ids))
        self._note_early(req, msg)
        self._sweep_at = min(self._sweep_at, reg.fence_at, now + cfg.liveness_timeout_s)
        reg.machine.handle(PT.PUSH_REG)
        bad = check_reg(req, reg, self._expected)
        if stale:
            self._fail(req, reg, PT.FENCE_EXPIRED)
        elif req.phase is Phase.ENDED:
            reason = TOMB_REASON.get(req.outcome or ProducerOutcome.EXPIRED, FailReason.LEASE_EXPIRED)
            reg.machine.handle(PT.ABORT if reason is FailReason.ABORTED else PT.LEASE_EXPIRED)
            reg.outbox.append(self._replies.failed(req.transfer_id, reg.key, reason))
            self._drop_ids(reg)
        elif bad is not None:
            self._fail(req, reg, PT.ABORT, bad)
        elif req.phase is Phase.HELD:
            reg.machine.handle(PT.PREFILL_DONE)
        # Overlap the full handshake with D with the prefill: it is needed to write, and to tell D anything.
        token = self._new_token()
        self._handshakes[token] = (req, reg)
        self.stats.handshakes_started += 1
        # A restarted D (same address, new life) must not be served from the old one's cache entry.
        self._do(
            StartHandshake(
                token,
                key,
                msg.host,
                msg.port,
                (0, msg.tp_rank),
                PeerMode.FULL,
                msg.engine_id,
                msg.incarnation,
            )
        )

    def _on_stale_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        """A notification queued while P was frozen: D may have declared P dead meanwhile and reused the
        blocks a push_reg names (found by the simulator: P thawed, served such a push_reg, and wrote into
        blocks D had freed). Such a push_reg is answered ``failed``/``fence_expired`` (D ends that rank, or
        ignores it when it ended already); a heartbeat proves nothing about D's view of P now; cancels
        are served."""
        if isinstance(msg, PushReg):
            # Registered and failed at once: the answer goes out once D is loaded (the handshake P makes
            # for any push_reg), as for a push_reg that finds a tombstone. D cannot be told otherwise.
            self._on_push_reg(now, key, sender, msg, stale=True)
            return
        if isinstance(msg, Cancel | Failed):
            self._on_cancel(now, key, sender, msg)
        elif not isinstance(msg, Heartbeat):
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender} in push mode")

    def _on_cancel(self, now: float, key: RankKey, sender: str, msg: Cancel | Failed) -> None:
        self._make_room()
        req = self._requests.get(msg.transfer_id) or self._early_cancel(msg)
        reg = None if req is None else req.regs.get((key, sender))
        if req is None:
            # No room for an early record: P's lease ends the request when it comes (counted).
            raise self._refuse(DropReason.OVERLOAD, f"cancel {msg.transfer_id} from {sender}: no room")
        if reg is None:
            # No registration from that D rank: nothing of ours writes for it. Remember the cancel, so a
            # push_reg arriving after it is refused, not written. A network duplicate is answered once
            # (one ending message per registration; the simulator found the second cancel_ack).
            if (key, sender) in req.cancelled:
                raise self._refuse(DropReason.DUPLICATE, f"cancel {msg.transfer_id} from {sender} again")
            if self._no_room(req):
                raise self._refuse(DropReason.OVERLOAD, f"cancel {msg.transfer_id} from {sender}: no room")
            req.cancelled.add((key, sender))
            req.gave_up.add((msg.engine_id, msg.incarnation))  # see given_up
            self._add_record(req, 0)
            self._send(key, sender, self._replies.cancel_ack(msg.transfer_id, key, wrote=False))
            self._settle(now, req)  # a D that gave up before it registered ends the request here
            return
        if not reg.machine.accepts(PT.CANCEL):
            raise self._refuse(DropReason.LATE, f"cancel {msg.transfer_id} in {reg.state.name}")
        self.stats.cancels += 1
        was_done = reg.state is ProducerState.DONE_SENT
        reg.machine.handle(PT.CANCEL)
        if was_done:
            return  # a cancel that crossed our done: D counts the done, no cancel_ack
        if reg.state is ProducerState.CANCELLED:
            self._cancel_ack(req, reg, wrote=False)
        self._settle(now, req)

    # -- engine inputs ---------------------------------------------------------------------------------------
    def _prefill_done(self, now: float, req: Request) -> None:
        self._sweep_at = min(self._sweep_at, req.lease_until)
        for reg in list(req.regs.values()):
            if reg.machine.accepts(PT.PREFILL_DONE):
                reg.machine.handle(PT.PREFILL_DONE)
            self._advance(now, req, reg)

    def _abort_regs(self, now: float, req: Request) -> None:
        for reg in list(req.regs.values()):
            self._fail(req, reg, PT.ABORT)

    def _settle(self, now: float, req: Request) -> None:
        """Emit the freeable event once nothing more can happen to a held request's blocks."""
        if req.phase is Phase.PREFILLING:
            if req.regs and registrations_ended(req):
                self._end(now, req, outcome(req), emit=False)
            elif given_up(req):
                self._end(now, req, ProducerOutcome.ABORTED, emit=False)
            return
        if req.phase is not Phase.HELD:
            return
        for r in req.regs.values():
            if r.posting or r.machine.writes_in_flight:
                return
        if req.aborted:
            self._end(now, req, ProducerOutcome.ABORTED, emit=True)
        elif all_ended(self.layouts, req, self._expected):
            self._end(now, req, outcome(req), emit=True)
        elif given_up(req):  # its D cancelled without a registration here: no rank of it will complete one
            self._end(now, req, ProducerOutcome.ABORTED, emit=True)
        elif now >= req.lease_until:  # each registration it ends counts lease_expired; none: counted once
            if not [r for r in list(req.regs.values()) if self._fail(req, r, PT.LEASE_EXPIRED)]:
                self.stats.failures[FailReason.LEASE_EXPIRED] += 1
            self._end(now, req, ProducerOutcome.EXPIRED, emit=True)

    # -- transfer inputs -------------------------------------------------------------------------------------
    def _on_transfer_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, HandshakeDone):
            req, reg = self._handshakes.pop(inp.token)
            self._on_d_handshake(now, req, reg, inp)
        elif isinstance(inp, Outcome):
            self._on_outcome(now, inp)
        elif isinstance(inp, XferEnded):
            self._on_xfer_ended(now, inp)
        elif isinstance(inp, Digested):
            req, reg, plan, done = self._digesting.pop(inp.token)
            if inp.digest is None:  # KV not in host memory: say so, not a digestless done D calls a mismatch
                reg.posting = False
                self._fail(req, reg, PT.WRITE_FAILED, FailReason.DIGEST_UNAVAILABLE)
                self._settle(now, req)
                return
            self.stats.digests += 1
            self._post_write(req, reg, plan, msgspec.structs.replace(done, digest=inp.digest))
        else:
            raise IllegalTransition(self.role, "push", type(inp).__name__)

    def _d_handshake_failed(self, req: Request, reg: Reg, inp: HandshakeDone, error: str) -> None:
        """No notification can reach a D that P could not load, but its side channel may: D is told there
        now (``report_failed``), not at its liveness timeout, whether the handshake's failure ends the
        registration or it had ended before (a ``failed`` waiting for D to be loaded)."""
        self.stats.handshakes_failed += 1
        self._log_info("handshake with D for %s failed: %s", req.transfer_id, error)
        reg.handshake_failed = True
        queued = [m for m in reg.outbox if isinstance(m, Failed)]
        reg.outbox.clear()
        reason = FailReason.INCOMPATIBLE if inp.reason is FailReason.INCOMPATIBLE else None
        if self._fail(req, reg, PT.HANDSHAKE_FAILED, reason):
            queued = [self._replies.failed(req.transfer_id, reg.key, reason or FailReason.HANDSHAKE_FAILED)]
        if queued and not inp.nobody_listens:
            self._report(reg.key, reg.msg, queued[-1])

    def _on_d_handshake(self, now: float, req: Request, reg: Reg, inp: HandshakeDone) -> None:
        peer, error = inp.peer, inp.error
        if peer is not None and (peer.incarnation != reg.msg.incarnation or peer.agent_name != reg.sender):
            error = f"D at {reg.msg.host}:{reg.msg.port} is now {peer.agent_name}, not {reg.sender}"
            peer = None
        if peer is None:
            self._d_handshake_failed(req, reg, inp, error)
            self._settle(now, req)
            return
        reg.peer = peer
        for msg in reg.outbox:
            self._send(reg.key, reg.sender, msg)
        reg.outbox.clear()
        if not reg.machine.registration_ended:
            try:
                # Refuse a bad registration at once, not at write time: P writes only inside D's cache.
                msg = reg.msg
                ids = moved_ids(self.engine.spec, msg.block_ids, msg.num_tokens, msg.num_cached_tokens)
                check_d_blocks(ids, peer.num_blocks)
            except BlockRangeError as exc:
                self._log_info("registration %s from %s refused: %s", req.transfer_id, reg.sender, exc)
                self._fail(req, reg, PT.ABORT, FailReason.BAD_REGISTRATION)
        self._advance(now, req, reg)
        self._settle(now, req)

    def _advance(self, now: float, req: Request, reg: Reg) -> None:
        """Start the write when the registration is connecting, D is loaded, and the fence allows."""
        if reg.state is not ProducerState.CONNECTING or reg.posting:
            return
        if reg.handshake_failed:
            self._fail(req, reg, PT.HANDSHAKE_FAILED)
        elif reg.peer is None:
            return  # the handshake's answer comes back here
        elif now > reg.fence_at:
            self._fail(req, reg, PT.FENCE_EXPIRED)
        else:
            self._write(now, req, reg)

    def _write(self, now: float, req: Request, reg: Reg) -> None:
        planned = self._plan_write(req, reg)
        if planned is not None:
            self._begin_write(now, req, reg, *planned)

    def _plan_write(self, req: Request, reg: Reg) -> tuple[TransferPlan, Done] | None:
        """The request's descriptors into this registration's blocks and the ``done`` that ends it; None
        when the registration cannot take them (it is then failed)."""
        msg, peer = reg.msg, reg.peer
        assert peer is not None
        bad = uncovered(req, reg)
        if bad is FailReason.SHORT_REGISTRATION:
            self._log_info(
                "registration %s from %s covers %d of %d tokens (%d blocks): refused",
                *(req.transfer_id, reg.sender, reg.msg.num_tokens, req.num_tokens, len(reg.msg.block_ids)),
            )
        if bad is not None or peer.layout is None:
            self._fail(req, reg, PT.WRITE_FAILED, bad or FailReason.BAD_REGISTRATION)
            return None
        try:
            plan = plan_transfer(
                self.engine.spec,
                self.layouts[reg.key],
                peer.layout,
                req.block_ids,
                msg.block_ids,
                num_tokens=msg.num_tokens,
                num_cached_tokens=msg.num_cached_tokens,
            )
        except (BlockRangeError, LayoutError) as exc:
            self._log_info("registration %s from %s refused: %s", req.transfer_id, reg.sender, exc)
            self._fail(req, reg, PT.WRITE_FAILED, FailReason.BAD_REGISTRATION)
            return None
        layers = common_layers(self.layouts[reg.key].layers, peer.layout.layers)
        slices = self._slices(msg.tp_size, reg.key[1], msg.tp_rank)
        done = Done(
            transfer_id=req.transfer_id,
            engine_id=self.engine.engine_id,
            incarnation=self.engine.incarnation,
            tp_rank=reg.key[1],
            pp_rank=reg.key[0],
            num_blocks=len(msg.block_ids) - msg.num_cached_tokens // peer.layout.block_size,
            reg_nonce=msg.reg_nonce,
            nbytes=payload_bytes(self.engine.spec, layers, slices, msg.num_cached_tokens, msg.num_tokens),
        )
        return plan, done

    def _begin_write(self, now: float, req: Request, reg: Reg, plan: TransferPlan, done: Done) -> None:
        """Post the write (after the digest of its source, when D asked for one)."""
        reg.posting, reg.posted_at = True, now
        msg = reg.msg
        if msg.want_digest:
            # D checks the bytes that land against this digest of the source (kv/digest.py).
            token = self._new_token()
            self._digesting[token] = (req, reg, plan, done)
            assert reg.peer is not None and reg.peer.layout is not None
            layers = common_layers(self.layouts[reg.key].layers, reg.peer.layout.layers)
            slices = pair_heads(self.engine.spec, self.engine.tp_size, msg.tp_size, reg.key[1], msg.tp_rank)
            heads = tuple((s.src_head, s.num_heads) for s in slices)
            scope = DigestScope(layers, heads, tuple(req.block_ids), msg.num_cached_tokens, msg.num_tokens)
            self._do(Digest(token, reg.key, scope))
            return
        self._post_write(req, reg, plan, done)

    def _slices(self, d_tp_size: int, tp_rank: int, d_rank: int) -> tuple[HeadSlice, ...]:
        """``pair_heads`` of local rank ``tp_rank`` and D rank ``d_rank``, memoized per core (per write)."""
        key = (d_tp_size, tp_rank, d_rank)
        slices = self._pair_heads.get(key)
        if slices is None:
            if len(self._pair_heads) >= 256:  # D engines of any TP size may come: keep it bounded
                self._pair_heads.clear()
            e = self.engine
            slices = self._pair_heads[key] = pair_heads(e.spec, e.tp_size, d_tp_size, tp_rank, d_rank)
        return slices

    def _post_write(self, req: Request, reg: Reg, plan: TransferPlan, done: Done) -> None:
        """Post the write with ``done`` attached (or send ``done`` alone when nothing moves)."""
        if plan.empty:  # D's prefix hit covers all, or this rank holds nothing D needs: just say so
            token = self._send(reg.key, reg.sender, done, answer=True)
            self._awaiting[token] = (req, reg, False)
            return
        token = self._new_token()
        self._awaiting[token] = (req, reg, True)
        self.stats.descriptors_posted += plan.num_descs
        self._sizes[token] = plan.nbytes
        self._do(
            PostWrite(
                token,
                reg.key,
                reg.sender,
                plan.src_array,
                plan.dst_array,
                encode_notif(done),
                plan.nbytes,
                req.transfer_id,
            )
        )

    def _on_outcome(self, now: float, inp: Outcome) -> None:
        req, reg, is_write = self._awaiting.pop(inp.token)
        reg.posting = False
        reg.machine.handle(PT.WRITES_POSTED)
        if not is_write:  # the bare done of an empty plan
            reg.machine.handle(PT.WRITES_COMPLETE if inp.ok else PT.WRITE_FAILED)
        elif inp.ok:
            reg.token = inp.token
            self._inflight[inp.token] = reg
            self.stats.transfers_started += 1
        else:
            self._sizes.pop(inp.token, None)
            self._log_info("posting %s to %s failed: %s", req.transfer_id, reg.sender, inp.detail)
            self._fail(req, reg, PT.WRITE_FAILED, FailReason.POST_FAILED, force=True)
        self._settle(now, req)

    def _on_xfer_ended(self, now: float, inp: XferEnded) -> None:
        reg = self._inflight.pop(inp.token)
        self._do(Release(inp.token))
        nbytes = self._sizes.pop(inp.token, 0)
        reg.token = 0
        req = self._requests[reg.msg.transfer_id]
        if inp.ok:
            reg.wrote = True
            self.stats.transfers_done += 1
            self.stats.bytes_moved += nbytes
            self.stats.record_duration(now - reg.posted_at)
            # Even after a cancel (CANCEL_PENDING): the done attached to the write went with it, and it is
            # this registration's one ending message, so no cancel_ack follows.
            reg.machine.handle(PT.WRITES_COMPLETE)
        else:
            self._write_failed(req, reg, FailReason.WRITE_FAILED)
            if inp.detail:
                self._log_info("write %s to %s failed: %s", req.transfer_id, reg.sender, inp.detail)
        self._settle(now, req)

    def _write_failed(self, req: Request, reg: Reg, reason: FailReason) -> None:
        if reg.state is ProducerState.CANCEL_PENDING:
            reg.machine.handle(PT.WRITE_FAILED)
            self._cancel_ack(req, reg, wrote=True)  # it may have landed in part
        else:
            self._fail(req, reg, PT.WRITE_FAILED, reason)

    def _recall(self, req: Request, reg: Reg, reason: FailReason) -> None:
        """Release a write in flight (NIXL cancels it) and end its registration: ``failed``, or
        ``cancel_ack`` (wrote: part of it may have landed) when D had cancelled."""
        self._do(Release(reg.token))
        self._inflight.pop(reg.token, None)
        self._sizes.pop(reg.token, None)
        reg.token = 0
        self._write_failed(req, reg, reason)

    # -- replies ---------------------------------------------------------------------------------------------
    def _fail(
        self, req: Request, reg: Reg, event: PT, reason: FailReason | None = None, *, force: bool = False
    ) -> bool:
        """End a registration in FAILED (if ``event`` applies now: True) and tell D, now or once D is
        loaded."""
        if not reg.machine.accepts(event):
            if force:
                raise IllegalTransition(self.role, reg.state.name, event.name)
            return False
        reg.machine.handle(event)
        self._drop_ids(reg)
        reason = reason or FAIL_REASONS[event]
        self.stats.failures[reason] += 1
        failed = self._replies.failed(req.transfer_id, reg.key, reason)
        if reg.peer is not None:
            self._send(reg.key, reg.sender, failed)
        elif not reg.handshake_failed:
            reg.outbox.append(failed)
        return True

    def _cancel_ack(self, req: Request, reg: Reg, wrote: bool) -> None:
        ack = self._replies.cancel_ack(req.transfer_id, reg.key, wrote)
        if reg.peer is not None:
            self._send(reg.key, reg.sender, ack)
        elif not reg.handshake_failed:
            reg.outbox.append(ack)

    # -- time ------------------------------------------------------------------------------------------------
    def _before(self, now: float, inp: Input) -> None:
        """Notice a freeze (SIGSTOP, a long stall) before anything else happens.

        A driver feeds a core at least every heartbeat period (``wake_at``), so a longer gap between two
        inputs means this process was frozen, and D may have declared it dead and reused the blocks it
        registered meanwhile. So, first, every write still posted is recalled (a frozen P would resume
        it at its first progress call); then, until the tick after next, what arrives is what queued up
        during the freeze, of unknown age (``_on_stale_notif``)."""
        paused = now - self._last_input
        self._last_input = now
        cfg = self.config
        if paused > cfg.liveness_timeout_s - cfg.heartbeat_interval_s:
            # The batch of the tick that follows (or this one) drains the notifications that queued up.
            self._stale_ticks = 1 if isinstance(inp, Tick) else 2
            if self._inflight:
                self._log_warning("paused %.2f s with writes in flight: recalling them", paused)
            for reg in list(self._inflight.values()):
                req = self._requests[reg.msg.transfer_id]
                self._recall(req, reg, FailReason.TRANSFER_TIMEOUT)
                self._settle(now, req)
        elif isinstance(inp, Tick) and self._stale_ticks:
            self._stale_ticks -= 1

    @property
    def _thawing(self) -> bool:
        return self._stale_ticks > 0

    def _timers(self, now: float) -> None:
        due = now >= self._sweep_at
        if due:
            for life in silent_d_lives(self._live_reqs, self._d_seen, now, self.config.liveness_timeout_s):
                self._d_dead(now, life)
        timeout = self.config.transfer_timeout_s
        late = [r for r in self._inflight.values() if now - r.posted_at > timeout]
        for reg in late:
            self._recall(self._requests[reg.msg.transfer_id], reg, FailReason.TRANSFER_TIMEOUT)
        if due or late:
            self._sweep(now)
            self._sweep_at = sweep_due(self._live_reqs, self._d_seen, self.config.liveness_timeout_s)
        if self._heartbeat_due(now):
            self._heartbeats()
            self._do(Reap(frozenset(engines_in_use(self._live_reqs))))
            held = {d_life(r) for q in self._live_reqs.values() for r in q.regs.values() if holding(r)}
            for life in [k for k in self._d_seen if k not in held]:
                del self._d_seen[life]

    def _sweep(self, now: float) -> None:
        """Expire fences, then settle every live request (a lease may have run out)."""
        for req in list(self._live_reqs.values()):
            for reg in req.regs.values():  # _fail changes a registration's state, never the table
                if fence_expired(reg, now):
                    self._fail(req, reg, PT.FENCE_EXPIRED)
            self._settle(now, req)

    def _d_dead(self, now: float, life: DLife) -> None:
        """D is silent past the liveness timeout: end everything P holds for it, then unload it.

        A write in flight cannot be recalled, only released (which cancels it); its source blocks stay
        quarantined until then, so the request's blocks become freeable only after the release."""
        silent = now - self._d_seen.get(life, now)
        held = [(req, reg) for req in self._live_reqs.values() for reg in req.regs.values()
                if d_life(reg) == life and holding(reg)]  # fmt: skip
        self._log_warning(
            "D %s/%s silent for %.1f s: declared dead; P held for it: %s",
            life[0], life[1], silent, waits(held, now),
        )  # fmt: skip
        self.stats.peers_declared_dead += 1
        for req, reg in held:  # _fail and _recall change a registration's state, never the tables
            if reg.machine.writes_in_flight:
                self._recall(req, reg, FailReason.PEER_DEAD)
            else:
                self._fail(req, reg, PT.PEER_DEAD)
        self._do(ForgetPeer(*life))
        self._d_seen.pop(life, None)
        for req, _ in held:
            self._settle(now, req)

    def _heartbeats(self) -> None:
        """Tell each D agent which of its registrations we still hold (a long prefill is alive)."""
        for (key, sender), tids in live_registrations(self._live_reqs).items():
            for heartbeat in self._replies.heartbeats(tids):  # one, unless the live set is that long
                self._send(key, sender, heartbeat)
            self.stats.heartbeats_sent += 1

    def _on_shutdown(self, now: float) -> None:
        for req in list(self._requests.values()):
            for reg in list(req.regs.values()):
                if not reg.machine.registration_ended and reg.peer is not None:
                    failed = self._replies.failed(req.transfer_id, reg.key, FailReason.SHUTDOWN)
                    self._send(reg.key, reg.sender, failed)
        super()._on_shutdown(now)
