"""D's cores: how D gets a request's KV into its blocks, as pure functions of ``(now, input)``.

``ConsumerCore`` holds what both modes share: the request table, the engine's calls (``Allocated``,
``Abort``), one ``ConsumerRequest`` machine per (request, local rank) over the P ranks that rank needs
(``source_ranks``), a handshake per P rank, the spreading of a failure to every local part, the one end
(READY, or FAILED then RELEASED, or RELEASED after an abort) per request, heartbeats to P.

``PushConsumerCore``: a notif-only handshake with each P rank, then a ``push_reg``; ``done`` from every
one makes it READY. A failure anywhere fails the request: FAILED is reported at once, ``cancel`` goes to
every rank still registered, and RELEASED comes when every P rank has ended its registration (``done``,
``failed``, ``cancel_ack``) or was declared dead (silent past ``liveness_timeout_s``) and
``dead_peer_grace_s`` passed. ``PullConsumerCore`` (``consumer_pull.py``) reads instead.
"""

from __future__ import annotations

from kvwire.core.base import CoreBase, DropReason
from kvwire.core.consumer_decline import Declines
from kvwire.core.consumer_liveness import Lives, drain_hold, quarantined, release_at
from kvwire.core.consumer_records import (
    Link,
    LocalPart,
    Pair,
    PairMemo,
    PeerLife,
    Request,
    UsedIds,
    check_allocation,
    sampled,
    wrong_peer,
)
from kvwire.core.events import ConsumerEvent, ConsumerEventKind
from kvwire.core.io import (
    Abort,
    Allocated,
    Decline,
    Digest,
    Digested,
    ForgetPeer,
    HandshakeDone,
    Input,
    Outcome,
    Reap,
    StartHandshake,
    TouchPeer,
)
from kvwire.core.types import PeerRank
from kvwire.errors import IllegalTransition, LayoutError, TransferIdReused, UnexpectedSender
from kvwire.kv.digest import DigestScope, payload_bytes
from kvwire.kv.mapping import HeadSlice, source_ranks
from kvwire.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    Notification,
    PushReg,
)
from kvwire.protocol.ranks import RankEnd, RankKey
from kvwire.protocol.states import ConsumerRequest, ConsumerState
from kvwire.protocol.states import ConsumerTrigger as CT
from kvwire.protocol.types import PeerMode

_DRAINING = (ConsumerState.FAILING, ConsumerState.CANCELLING)
_FAILED = (ConsumerState.FAILING, ConsumerState.FAILED)


class ConsumerCore(CoreBase):
    role = "consumer"
    peer_mode = PeerMode.NOTIF_ONLY

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.engine.pp_size != 1:
            raise LayoutError("a consumer (D) engine runs with pp_size 1")
        self._requests: dict[str, Request] = {}
        self._lives = Lives()
        self._life = self._lives.table  # (engine_id, incarnation) of P engines
        self._handshakes: dict[int, tuple[Request, LocalPart, Link]] = {}
        self._probes: dict[int, tuple[str, str]] = {}  # who is at a dead P life's address now
        self._declines = Declines(self.engine, self.layouts, self.peer_mode)
        # Every transfer id this life registered: single use (a done of the other request must not
        # complete a new one), and a done naming one after it ended is told from a never-seen id.
        self._used = UsedIds(self.config.max_served_ids)
        self._held: dict[str, Request] = {}  # every rank ended, blocks held (Request.hold_until)

    def watched_peers(self) -> list[tuple[str, str]]:
        """P lives whose liveness D tracks now (only those live requests wait on)."""
        return list(self._life)

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def _live(self) -> bool:
        return bool(self._requests)

    # -- engine inputs ---------------------------------------------------------------------------------------
    def _on_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, Allocated):
            self._allocated(now, inp)
        elif isinstance(inp, Abort):
            self._abort(now, inp.transfer_id)
        elif isinstance(inp, Decline):  # (one allocated after all is not told: the engine aborts it)
            if hs := self._declines.start(inp, self._new_token, self._requests):
                self.stats.declined += 1
                self._out.extend(hs)
        elif isinstance(inp, HandshakeDone) and inp.token in self._declines:
            if (told := self._declines.answered(inp)) is not None:
                self._send(*told)
        elif isinstance(inp, HandshakeDone) and inp.token in self._probes:
            self._lives.probed(self._probes.pop(inp.token), inp, now)
        elif isinstance(inp, HandshakeDone):
            req, part, link = self._handshakes.pop(inp.token)
            self._on_p_handshake(now, req, part, link, inp)
        elif isinstance(inp, Outcome):
            self._on_outcome(now, inp)
        else:
            self._on_transfer_input(now, inp)

    def _on_transfer_input(self, now: float, inp: Input) -> None:
        raise IllegalTransition(self.role, "any", type(inp).__name__)

    def _on_outcome(self, now: float, inp: Outcome) -> None:
        raise IllegalTransition(self.role, "any", "Outcome")

    def _allocated(self, now: float, inp: Allocated) -> None:
        check_allocation(self.engine, self.num_blocks, inp)
        if inp.transfer_id in self._requests or not self._used.add(inp.transfer_id):
            raise TransferIdReused(inp.transfer_id)
        remote = inp.remote
        req = Request(inp.transfer_id, list(inp.block_ids), inp.num_tokens, inp.num_cached_tokens, remote)
        try:
            for key, layout in self.layouts.items():
                srcs = source_ranks(self.engine.spec, remote.tp_size, remote.pp_size, layout)
                links = {src: Link(src) for src in srcs}
                req.parts[key] = LocalPart(key, ConsumerRequest(self.config.mode, srcs), links)
        except (LayoutError, UnexpectedSender) as exc:
            self._log_info(
                "%s cannot map P (tp %d, pp %d): %s", inp.transfer_id, remote.tp_size, remote.pp_size, exc
            )
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.FAILED, FailReason.INCOMPATIBLE))
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.RELEASED, FailReason.INCOMPATIBLE))
            return
        self._requests[req.transfer_id] = req
        for part in req.parts.values():
            part.machine.handle(CT.REGISTER)
            for link in part.links.values():
                self._handshake(req, part, link)

    def _handshake(self, req: Request, part: LocalPart, link: Link) -> None:
        token = self._new_token()
        self._handshakes[token] = (req, part, link)
        self.stats.handshakes_started += 1
        remote = req.remote
        self._do(
            StartHandshake(
                token,
                part.key,
                remote.host_of(link.src),
                remote.port_of(link.src),
                link.src,
                self.peer_mode,
                remote.engine_id,
            )
        )

    def _abort(self, now: float, transfer_id: str) -> None:
        req = self._requests.get(transfer_id)
        if req is None:
            return  # already READY or RELEASED: the blocks are the engine's
        req.aborted = True
        for part in req.parts.values():
            if part.machine.accepts(CT.CANCEL):
                part.machine.cancel()
        self._settle(now, req)

    def _fail(self, req: Request, part: LocalPart, event: CT, reason: FailReason) -> None:
        req.reason = req.reason or reason
        self.stats.failures[reason] += 1
        if part.machine.accepts(event):
            part.machine.fail(event)

    def _settle(self, now: float, req: Request) -> None:
        """Spread a failure to every local part, drain, and report the request's end exactly once."""
        # Explicit loops, not any()/all() over generators: this runs after every input of every request
        # and at every timer pass, over one or two parts.
        parts = list(req.parts.values())
        if not req.reported_failed and not req.aborted:
            for p in parts:
                if p.machine.state in _FAILED:
                    req.reported_failed = True
                    self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.FAILED, req.reason))
                    for q in parts:
                        if q.machine.state not in _DRAINING and q.machine.accepts(CT.CANCEL):
                            q.machine.cancel()
                    break
        ready = bool(parts)
        for p in parts:
            state = p.machine.state
            if state is not ConsumerState.READY:
                ready = False  # a draining part ends terminal, never READY
                if state in _DRAINING:
                    self._drain(req, p)
        if ready:
            self._ended(req, None)
            del self._requests[req.transfer_id]
            self.stats.transfers_done += 1
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.READY))
        elif all(p.machine.is_terminal for p in parts):
            if now < req.hold_until:
                self._held[req.transfer_id] = req  # released by the timer pass once the hold is over
                return
            self._held.pop(req.transfer_id, None)
            self._ended(req, req.reason or FailReason.ABORTED)
            del self._requests[req.transfer_id]
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.RELEASED, req.reason))

    def _drain(self, req: Request, part: LocalPart) -> None:
        """A draining part: tell what may still land in its blocks to stop (and end it when nothing can)."""

    def _ended(self, req: Request, reason: FailReason | None) -> None:
        """The request is over on D (READY when ``reason`` is None)."""

    def _on_p_handshake(
        self, now: float, req: Request, part: LocalPart, link: Link, inp: HandshakeDone
    ) -> None:
        if self._requests.get(req.transfer_id) is not req:
            return
        peer = inp.peer
        if peer is None:
            self.stats.handshakes_failed += 1
            self._log_info("handshake with P %s for %s failed: %s", link.src, req.transfer_id, inp.error)
            self._fail(req, part, CT.HANDSHAKE_FAILED, inp.reason)
        elif (wrong := wrong_peer(peer, req.remote)) is not None:
            reason, why = wrong
            log = self._log_info if reason is FailReason.PEER_DEAD else self._log_warning  # a restart is news
            log("%s: %s", req.transfer_id, why)
            self._fail(req, part, CT.HANDSHAKE_FAILED, reason)
        else:
            self._linked(now, req, part, link, peer, fresh=not inp.cached)
        self._settle(now, req)

    def _linked(
        self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank, *, fresh: bool
    ) -> None:
        """The handshake with ``link``'s P rank succeeded."""
        if part.machine.state is not ConsumerState.REGISTERING:
            return
        link.peer = peer
        life = self._life.get((peer.engine_id, peer.incarnation))
        if life is None:
            life = self._life[(peer.engine_id, peer.incarnation)] = PeerLife(now)
        elif life.dead_at is not None:
            # A dead life's agent was forgotten, so this answer is a fresh one: alive again (a healed
            # partition, a thaw). Links that got the verdict keep it (their own dead_at) and go on to their
            # grace and quarantine; this request does not inherit it. A cached answer is no sign of life
            # (found by the simulator: new requests kept a silent P "alive" and old ones waiting forever).
            life.dead_at = None
            life.last_seen = max(life.last_seen, now)
        self._lives.answered(life, peer, now, fresh=fresh)
        self._start(now, req, part, link, peer)

    def _start(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
        raise NotImplementedError

    # -- peers -----------------------------------------------------------------------------------------------
    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        life = self._life.get((msg.engine_id, msg.incarnation))
        if life is not None:
            if not isinstance(msg, Heartbeat) and now - life.last_seen > self.config.heartbeat_interval_s:
                self._do(TouchPeer(msg.engine_id))  # its first word after a silence: a tripped circuit closes
            self._lives.heard(life, now)
        if isinstance(msg, Heartbeat):
            self._do(TouchPeer(msg.engine_id))
            return
        self._on_peer_msg(now, key, sender, msg)

    def _on_peer_msg(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender}")

    def _end_forgotten(self, now: float) -> None:
        pass

    def _timers(self, now: float) -> None:
        for req in [r for r in self._held.values() if now >= r.hold_until]:
            self._settle(now, req)
        if self._heartbeat_due(now):
            self._end_forgotten(now)
            self._heartbeats()
            self._do(Reap(frozenset(req.remote.engine_id for req in self._requests.values())))
            self._lives.prune(self._requests)

    def _heartbeats(self) -> None:
        for key, agent_name, hb in self._lives.heartbeats(self._requests, self.engine):
            self._send(key, agent_name, hb)
            self.stats.heartbeats_sent += 1

    def _before(self, now: float, inp: Input) -> None:  # D's own freeze is no P's silence (Lives.input_at)
        self._lives.input_at(now, self.config.liveness_timeout_s - self.config.heartbeat_interval_s)

    def _on_shutdown(self, now: float) -> None:
        for req in list(self._requests.values()):
            req.aborted, req.hold_until = True, 0.0  # the engine's memory goes with it (P is told aborted)
            for part in req.parts.values():
                if part.machine.accepts(CT.CANCEL):
                    part.machine.cancel()
            self._settle(now, req)  # P's ranks are told to stop (push), reads released (pull)
            if self._requests.get(req.transfer_id) is req:  # no answer will be read: the parts end here
                for part in (p for p in req.parts.values() if not p.machine.is_terminal):
                    part.machine.shutdown()
                self._settle(now, req)


class PushConsumerCore(ConsumerCore):
    """Push: D registers its blocks with every P rank it needs and waits for their ``done``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._sending: dict[int, tuple[Request, LocalPart, Link]] = {}  # push_reg token
        self._digesting: dict[int, tuple[Request, LocalPart, RankKey, Done]] = {}  # Digest token
        self._reg_seq = 0  # the last reg_nonce given (unique in this life; never 0, an old peer's echo)
        self._pairs = PairMemo()

    @property
    def busy(self) -> bool:
        """A registration waits for P's writes: they may land (with ``done``) at any moment, and D polls
        for that ``done``, so it polls at the busy rate; idle backoff here delayed READY by up to the idle
        interval (2 ms) after the last byte."""
        parts = (p for r in self._requests.values() for p in r.parts.values())
        return any(p.machine.state is ConsumerState.WAITING for p in parts)

    def _start(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
        self._reg_seq += 1
        link.reg_nonce = self._reg_seq
        link.want_digest = sampled(req.transfer_id, self.config.kv_digest_sample)
        reg = PushReg(
            transfer_id=req.transfer_id,
            engine_id=self.engine.engine_id,
            incarnation=self.engine.incarnation,
            tp_rank=part.key[1],
            tp_size=self.engine.tp_size,
            host=self.host,
            port=self.port,
            block_ids=req.block_ids,
            num_tokens=req.num_tokens,
            num_cached_tokens=req.num_cached_tokens,
            fence_ms=self.config.fence_ms,
            reg_nonce=link.reg_nonce,
            want_digest=link.want_digest,
            idle_ranks=True,
        )
        link.sending = True
        self._sending[self._send(part.key, peer.agent_name, reg, answer=True)] = (req, part, link)

    def _on_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, Digested):
            req, part, src, done = self._digesting.pop(inp.token)
            self.stats.digests += 1
            ok = inp.digest is not None and inp.digest == done.digest
            if not ok:
                self._log_warning(
                    "%s: the KV from %s does not match its digest (%s here, %s stated)", req.transfer_id,
                    src, inp.digest.hex() if inp.digest else None, done.digest.hex() if done.digest else None,
                )  # fmt: skip
            self._rank_done(now, req, part, src, None if ok else FailReason.DIGEST_MISMATCH)
        else:
            super()._on_input(now, inp)

    def _on_outcome(self, now: float, inp: Outcome) -> None:
        req, part, link = self._sending.pop(inp.token)
        link.sending = False
        if inp.ok:
            link.registered_at = now
            self.stats.transfers_started += 1
            part.machine.push_reg_sent(link.src)  # raises if the request drained meanwhile: a driver bug
            if link.peer is not None:
                self._lives.registered(link.peer, now)
        elif not link.rehandshaked and link.peer is not None:
            # The cached entry may be of a P that restarted at the same address (NIXL #795): forget that
            # life of it and handshake again, once; the new life gets the registration.
            peer, link.rehandshaked, link.peer = link.peer, True, None
            self._do(ForgetPeer(peer.engine_id, peer.incarnation))
            self._handshake(req, part, link)
        else:
            self._fail(req, part, CT.HANDSHAKE_FAILED, FailReason.HANDSHAKE_FAILED)
        self._settle(now, req)

    def _drain(self, req: Request, part: LocalPart) -> None:
        for src in part.machine.ranks.pending:
            link = part.links[src]
            if not link.cancel_sent and link.peer is not None:
                link.cancel_sent = True
                self.stats.cancels += 1
                cancel = Cancel(
                    transfer_id=req.transfer_id,
                    engine_id=self.engine.engine_id,
                    incarnation=self.engine.incarnation,
                )
                self._send(part.key, link.peer.agent_name, cancel)

    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        if isinstance(msg, Heartbeat) and (msg.engine_id, msg.incarnation) in self._lives.table:
            self._lives.note_listed(self._requests, key, sender, msg.transfer_ids, now)
        super()._on_notif(now, key, sender, msg)

    def _end_forgotten(self, now: float) -> None:
        """End the ranks whose P rank, alive, no longer names their registration (``Lives.forgotten``): the
        blocks wait the grace, since the lost word may have been a ``failed`` after a released write."""
        for req, part, link in self._lives.forgotten(self._requests, now, self.config):
            self._log_warning(
                "%s: P rank %s stopped naming it, its last word lost", req.transfer_id, link.src
            )
            req.hold_until = max(req.hold_until, now + self.config.dead_peer_grace_s)
            self._rank_ended(now, req, part, link.src, RankEnd.FAILED, FailReason.TRANSFER_TIMEOUT)

    def _on_peer_msg(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        if not isinstance(msg, Done | Failed | CancelAck):
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender}")
        req = self._requests.get(msg.transfer_id)
        part = None if req is None else req.parts.get(key)
        if req is None and isinstance(msg, CancelAck) and self._declines.told(msg.transfer_id):
            return  # P acks the cancel that told it of a request we declined: expected, not a stray
        if req is None or part is None:
            # A transfer this life served (a late or replayed message) is told from one it never saw.
            ended = req is None and msg.transfer_id in self._used
            why = DropReason.ENDED_TRANSFER if ended else DropReason.UNKNOWN_TRANSFER
            raise self._refuse(why, f"{type(msg).__name__} {msg.transfer_id} from {sender}")
        src = (msg.pp_rank, msg.tp_rank)
        link = part.links.get(src)
        if link is None or link.peer is None or link.peer.agent_name != sender:
            stale = link is not None and link.peer is not None and link.peer.engine_id == msg.engine_id
            why = DropReason.STALE_INCARNATION if stale else DropReason.WRONG_SENDER
            raise self._refuse(why, f"{type(msg).__name__} {msg.transfer_id} from {sender} as {src}")
        if isinstance(msg, Done):
            self._on_done(now, req, part, link, msg)
            return
        if isinstance(msg, Failed) and self._idle_refusal(now, req, part, msg):
            return
        if src in part.machine.ranks.pending:  # a replay for an ended rank is refused below: it holds nothing
            req.hold_until = max(req.hold_until, drain_hold(msg, now, self.config.dead_peer_grace_s))
        how = RankEnd.FAILED if isinstance(msg, Failed) else RankEnd.CANCEL_ACKED
        self._rank_ended(now, req, part, src, how, msg.reason if isinstance(msg, Failed) else None)

    def _idle_refusal(self, now: float, req: Request, part: LocalPart, msg: Failed) -> bool:
        """A P rank that moves nothing here (``tp_contacts``) refused our registration: a P from before such
        ranks were told the end. It writes nothing, so that ends it as done, and the load goes on."""
        src = (msg.pp_rank, msg.tp_rank)
        bad = msg.reason is not FailReason.BAD_REGISTRATION or src not in part.machine.ranks.pending
        if bad or self._slices(req, part, src):
            return False
        self._log_info("%s: P rank %s (moves nothing here) refused the registration", req.transfer_id, src)
        self._rank_done(now, req, part, src, None)
        return True

    def _rank_ended(
        self, now: float, req: Request, part: LocalPart, src: RankKey, how: RankEnd, reason: FailReason | None
    ) -> None:
        try:
            part.machine.rank_ended(src, how)
        except (IllegalTransition, UnexpectedSender) as exc:
            raise self._refuse(DropReason.LATE, f"{req.transfer_id} from {src}: {exc}") from None
        if reason is not None:
            req.reason = req.reason or reason
            self.stats.failures[reason] += 1
        self._settle(now, req)

    def _rank_done(
        self, now: float, req: Request, part: LocalPart, src: RankKey, bad: FailReason | None
    ) -> None:
        """A P rank's writes are over: DONE, or FAILED when ``bad`` says its done cannot be trusted (the
        rank ended all the same: P says nothing more of it will land, so it is failed, not pending)."""
        self._rank_ended(now, req, part, src, RankEnd.DONE if bad is None else RankEnd.FAILED, bad)

    def _on_done(self, now: float, req: Request, part: LocalPart, link: Link, msg: Done) -> None:
        """Take a ``done`` only when it states what D registered and what this P rank had to write (a done
        with no write before it, or of another registration, fails the request: never READY on it)."""
        src = link.src
        if src not in part.machine.ranks.pending:  # a duplicate: refused before it is judged (or logged)
            raise self._refuse(DropReason.LATE, f"done {req.transfer_id} from {src}: the rank has ended")
        scope = self._payload(req, part, src)
        slices = self._slices(req, part, src)
        want = payload_bytes(self.engine.spec, scope.layers, slices, req.num_cached_tokens, req.num_tokens)
        problem = None
        if msg.num_blocks != self._expected_blocks(req):
            problem = f"num_blocks {msg.num_blocks}, registered {self._expected_blocks(req)}"
        elif msg.reg_nonce != link.reg_nonce:
            problem = f"reg_nonce {msg.reg_nonce}, registered {link.reg_nonce} (a replay, or a peer too old)"
        elif msg.nbytes != want:
            problem = f"nbytes {msg.nbytes}, this rank pair moves {want}"
        if problem is not None:
            self._log_warning("%s: done from %s refused: %s", req.transfer_id, link.src, problem)
            self._rank_done(now, req, part, src, FailReason.BAD_DONE)
            return
        # REGISTERING too: with several P ranks, one's done may come before the last push_reg is out.
        verify = (
            link.want_digest
            and part.machine.state in (ConsumerState.REGISTERING, ConsumerState.WAITING)
            and src in part.machine.ranks.pending
        )
        if not verify:
            self._rank_done(now, req, part, src, None)
            return
        token = self._new_token()
        self._digesting[token] = (req, part, src, msg)
        self._do(Digest(token, part.key, scope))

    def _pair(self, req: Request, part: LocalPart, src: RankKey) -> Pair:
        """The layers and head slices P rank ``src`` writes into local rank ``part`` (asked per ``done``)."""
        remote, e = req.remote, self.engine
        return self._pairs.get(
            e.spec, (remote.tp_size, remote.pp_size, e.tp_size), src, self.layouts[part.key]
        )

    def _slices(self, req: Request, part: LocalPart, src: RankKey) -> tuple[HeadSlice, ...]:
        return self._pair(req, part, src)[2]

    def _payload(self, req: Request, part: LocalPart, src: RankKey) -> DigestScope:
        """What P rank ``src`` writes into local rank ``part`` for ``req``, in D's blocks."""
        layers, heads, _ = self._pair(req, part, src)
        return DigestScope(layers, heads, tuple(req.block_ids), req.num_cached_tokens, req.num_tokens)

    def _expected_blocks(self, req: Request) -> int:
        """The ``num_blocks`` a P rank's ``done`` must carry: the blocks past D's prefix hit."""
        return len(req.block_ids) - req.num_cached_tokens // self.engine.spec.block_size

    def _timers(self, now: float) -> None:
        self._check_liveness(now)
        super()._timers(now)

    def _check_liveness(self, now: float) -> None:
        """Declare silent P lives dead and end the ranks whose verdict's grace (or quarantine) is over;
        only the links that can act are visited (``Lives.due``), and a request is settled when it changed."""
        for req, links in self._lives.due(now, self._requests, self.config.liveness_timeout_s):
            changed = False
            for part, link, life in links:
                changed = self._link_liveness(now, req, part, link, life) or changed
            if changed and self._requests.get(req.transfer_id) is req:
                self._settle(now, req)

    def _link_liveness(self, now: float, req: Request, part: LocalPart, link: Link, life: PeerLife) -> bool:
        """One registered link of a watched life or with a verdict; whether the part changed."""
        peer = link.peer
        assert peer is not None
        cfg = self.config
        changed = False
        silent = now - max(life.last_seen, link.registered_at)
        if life.dead_at is None and silent > cfg.liveness_timeout_s:
            self._declare_dead(now, part.key, peer, life)
            changed = True
        if life.dead_at is not None and link.dead_at is None:
            self._lives.give_verdict(link, life)
            self._fail(req, part, CT.TIMEOUT, FailReason.PEER_DEAD)
            changed = True
        dead_at = link.dead_at
        if dead_at is None or not part.machine.accepts(CT.RANK_DEAD):
            return changed
        until = self._release_at(life, dead_at)
        if now < until:
            self._lives.verdict_waits(until)
            return changed
        if life.confirmed.get(dead_at) is None:
            self._quarantine_expired(now, life, dead_at)
        part.machine.rank_ended(link.src, RankEnd.DEAD)
        return True

    def _release_at(self, life: PeerLife, dead_at: float) -> float:
        """``release_at`` under this core's limits (a method: a simulator plant overrides it)."""
        return release_at(life, dead_at, self.config.dead_peer_grace_s, self.config.dead_quarantine_s)

    def _quarantine_expired(self, now: float, life: PeerLife, dead_at: float) -> None:
        """Count and log a release at the quarantine bound (the life was never confirmed)."""
        self.stats.quarantine_expired += 1
        self._log_warning(
            "P life %s unconfirmed %.0f s after it was declared dead: releasing its blocks",
            next((f"{e}/{i}" for (e, i), v in self._life.items() if v is life), "?"),
            now - dead_at,
        )

    def quarantined(self) -> int:
        """Requests whose blocks wait on a dead P life's confirmation (for /health and metrics)."""
        return quarantined(self._requests)

    def _declare_dead(self, now: float, key: RankKey, peer: PeerRank, life: PeerLife) -> None:
        silent = now - life.last_seen
        self._log_warning(
            "P %s/%s silent for %.1f s: declared dead", peer.engine_id, peer.incarnation, silent
        )
        self._lives.declared_dead(peer, life, now)
        self.stats.peers_declared_dead += 1
        self._do(ForgetPeer(peer.engine_id, peer.incarnation))
        # Ask its address who is there now: a refused connection (a killed process's socket is closed) or
        # another life confirms this one gone, so its blocks need not wait for the quarantine bound. A
        # timeout (frozen, partitioned) or the same life answering confirms nothing. No engine id is
        # asked for: a restarted engine usually has a new one, and the handshake would refuse it as
        # another engine (a chaos run held D's blocks 30 s, to the bound, after every P restart).
        token = self._new_token()
        self._probes[token] = (peer.engine_id, peer.incarnation)
        remote = (peer.pp_rank, peer.tp_rank)
        self._do(StartHandshake(token, key, peer.host, peer.port, remote, PeerMode.NOTIF_ONLY))
