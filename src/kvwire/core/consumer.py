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

from collections import defaultdict

from kvwire.core.base import CoreBase, DropReason
from kvwire.core.consumer_records import Link, LocalPart, PeerLife, Request
from kvwire.core.events import ConsumerEvent, ConsumerEventKind
from kvwire.core.io import (
    Abort,
    Allocated,
    ForgetPeer,
    HandshakeDone,
    Input,
    Outcome,
    Reap,
    StartHandshake,
    TouchPeer,
)
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError, UnexpectedSender
from kvwire.handshake.types import EngineInfo, PeerRank
from kvwire.kv.mapping import source_ranks
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
from kvwire.transport.base import PeerMode

_DRAINING = (ConsumerState.FAILING, ConsumerState.CANCELLING)


def check_allocation(engine: EngineInfo, num_blocks: int, inp: Allocated) -> None:
    """The engine's ``request_allocated`` arguments, checked before anything is sent (raises)."""
    ids, spec, tid = inp.block_ids, engine.spec, inp.transfer_id
    if any(not 0 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
        raise BlockRangeError(f"{tid}: local block ids out of range or repeated")
    n, cached = inp.num_tokens, inp.num_cached_tokens
    if n <= 0 or not 0 <= cached <= n or cached % spec.block_size:
        raise LayoutError(f"{tid}: bad token counts {n}/{cached}")
    if len(ids) * spec.block_size < n:
        raise BlockRangeError(f"{tid}: {len(ids)} blocks cannot hold {n} tokens")


class ConsumerCore(CoreBase):
    role = "consumer"
    peer_mode = PeerMode.NOTIF_ONLY

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.engine.pp_size != 1:
            raise LayoutError("a consumer (D) engine runs with pp_size 1")
        self._requests: dict[str, Request] = {}
        self._life: dict[tuple[str, str], PeerLife] = {}  # (engine_id, incarnation) of P engines
        self._handshakes: dict[int, tuple[Request, LocalPart, Link]] = {}
        self._probes: dict[int, tuple[str, str]] = {}  # who is at a dead P life's address now

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
        elif isinstance(inp, HandshakeDone) and inp.token in self._probes:
            self._on_probe(inp)
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
        if inp.transfer_id in self._requests:
            raise IllegalTransition(self.role, "ALLOCATED", "ALLOCATED")
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
                remote.host,
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
        parts = list(req.parts.values())
        failed = any(p.machine.state in (ConsumerState.FAILING, ConsumerState.FAILED) for p in parts)
        if failed and not req.reported_failed and not req.aborted:
            req.reported_failed = True
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.FAILED, req.reason))
            for p in parts:
                if p.machine.state not in _DRAINING and p.machine.accepts(CT.CANCEL):
                    p.machine.cancel()
        for p in parts:
            if p.machine.state in _DRAINING:
                self._drain(req, p)
        states = {p.machine.state for p in parts}
        if states == {ConsumerState.READY}:
            self._ended(req, None)
            del self._requests[req.transfer_id]
            self.stats.transfers_done += 1
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.READY))
        elif all(p.machine.is_terminal for p in parts):
            self._ended(req, req.reason or FailReason.ABORTED)
            del self._requests[req.transfer_id]
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.RELEASED, req.reason))

    def _drain(self, req: Request, part: LocalPart) -> None:
        """A draining part: tell what may still land in its blocks to stop (and end it when nothing can)."""

    def _ended(self, req: Request, reason: FailReason | None) -> None:
        """The request is over on D (READY when ``reason`` is None)."""

    def _on_probe(self, inp: HandshakeDone) -> None:
        engine_id, incarnation = self._probes.pop(inp.token)
        life = self._life.get((engine_id, incarnation))
        if life is None:
            return
        if inp.nobody_listens or (inp.peer is not None and inp.peer.incarnation != incarnation):
            life.gone = True

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
        else:
            self._linked(now, req, part, link, peer)
        self._settle(now, req)

    def _linked(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
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
        for (engine_id, incarnation), other in self._life.items():
            if engine_id == peer.engine_id and incarnation != peer.incarnation:
                other.gone = True  # a newer life answers at that address: the older process is over
        self._start(now, req, part, link, peer)

    def _start(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
        raise NotImplementedError

    # -- peers -----------------------------------------------------------------------------------------------
    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        life = self._life.get((msg.engine_id, msg.incarnation))
        if life is not None:
            life.last_seen = max(life.last_seen, now)
            life.last_msg = now
        if isinstance(msg, Heartbeat):
            self._do(TouchPeer(msg.engine_id))
            return
        self._on_peer_msg(now, key, sender, msg)

    def _on_peer_msg(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender}")

    def _timers(self, now: float) -> None:
        if self._heartbeat_due(now):
            self._heartbeats()
            self._do(Reap(frozenset(req.remote.engine_id for req in self._requests.values())))
            self._prune_life()

    def _prune_life(self) -> None:
        """Forget the liveness of P lives no live request waits on (the map would grow with every restart)."""
        referenced = {
            (link.peer.engine_id, link.peer.incarnation)
            for req in self._requests.values()
            for part in req.parts.values()
            for link in part.links.values()
            if link.peer is not None
        }
        for life_key in [k for k in self._life if k not in referenced]:
            del self._life[life_key]

    def _heartbeats(self) -> None:
        live: dict[tuple[RankKey, str], list[str]] = defaultdict(list)
        for req in self._requests.values():
            for part in req.parts.values():
                for link in part.links.values():
                    if link.peer is not None and link.dead_at is None:
                        live[(part.key, link.peer.agent_name)].append(req.transfer_id)
        for (key, agent_name), tids in live.items():
            hb = Heartbeat(
                transfer_id="",
                engine_id=self.engine.engine_id,
                incarnation=self.engine.incarnation,
                transfer_ids=tids,
            )
            self._send(key, agent_name, hb)
            self.stats.heartbeats_sent += 1

    def _on_shutdown(self, now: float) -> None:
        for req in list(self._requests.values()):
            req.aborted = True
            for part in req.parts.values():
                if part.machine.accepts(CT.CANCEL):
                    part.machine.cancel()
            self._settle(now, req)


class PushConsumerCore(ConsumerCore):
    """Push: D registers its blocks with every P rank it needs and waits for their ``done``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._sending: dict[int, tuple[Request, LocalPart, Link]] = {}  # push_reg token

    @property
    def busy(self) -> bool:
        """A registration waits for P's writes: they may land (with ``done``) at any moment, and D polls
        for that ``done``, so it polls at the busy rate; idle backoff here delayed READY by up to the idle
        interval (2 ms) after the last byte."""
        parts = (p for r in self._requests.values() for p in r.parts.values())
        return any(p.machine.state is ConsumerState.WAITING for p in parts)

    def _start(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
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
        )
        link.sending = True
        self._sending[self._send(part.key, peer.agent_name, reg, answer=True)] = (req, part, link)

    def _on_outcome(self, now: float, inp: Outcome) -> None:
        req, part, link = self._sending.pop(inp.token)
        link.sending = False
        if inp.ok:
            link.registered_at = now
            self.stats.transfers_started += 1
            part.machine.push_reg_sent(link.src)  # raises if the request drained meanwhile: a driver bug
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

    def _on_peer_msg(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        if not isinstance(msg, Done | Failed | CancelAck):
            raise self._refuse(DropReason.UNEXPECTED, f"{type(msg).__name__} from {sender}")
        req = self._requests.get(msg.transfer_id)
        part = None if req is None else req.parts.get(key)
        if req is None or part is None:
            raise self._refuse(
                DropReason.UNKNOWN_TRANSFER, f"{type(msg).__name__} {msg.transfer_id} from {sender}"
            )
        src = (msg.pp_rank, msg.tp_rank)
        link = part.links.get(src)
        if link is None or link.peer is None or link.peer.agent_name != sender:
            stale = link is not None and link.peer is not None and link.peer.engine_id == msg.engine_id
            why = DropReason.STALE_INCARNATION if stale else DropReason.WRONG_SENDER
            raise self._refuse(why, f"{type(msg).__name__} {msg.transfer_id} from {sender} as {src}")
        how = RankEnd.DONE if isinstance(msg, Done) else RankEnd.CANCEL_ACKED
        reason = msg.reason if isinstance(msg, Failed) else None
        if isinstance(msg, Failed):
            how = RankEnd.FAILED
        elif isinstance(msg, Done) and msg.num_blocks != self._expected_blocks(req):
            # Not what D registered: the KV cannot be trusted. The rank ended all the same (P says its
            # writes are over), so it counts as failed, not pending.
            how, reason = RankEnd.FAILED, FailReason.BAD_DONE
        try:
            part.machine.rank_ended(src, how)
        except (IllegalTransition, UnexpectedSender) as exc:
            raise self._refuse(DropReason.LATE, f"{type(msg).__name__} {msg.transfer_id}: {exc}") from None
        if reason is not None:
            req.reason = req.reason or reason
            self.stats.failures[reason] += 1
        self._settle(now, req)

    def _expected_blocks(self, req: Request) -> int:
        """The ``num_blocks`` a P rank's ``done`` must carry: the blocks past D's prefix hit."""
        return len(req.block_ids) - req.num_cached_tokens // self.engine.spec.block_size

    def _timers(self, now: float) -> None:
        self._check_liveness(now)
        super()._timers(now)

    def _check_liveness(self, now: float) -> None:
        cfg = self.config
        for req in list(self._requests.values()):
            for part in req.parts.values():
                for src in part.machine.ranks.pending:
                    link = part.links[src]
                    peer = link.peer
                    if peer is None:
                        continue
                    life = self._life[(peer.engine_id, peer.incarnation)]
                    silent = now - max(life.last_seen, link.registered_at)
                    if life.dead_at is None and silent > cfg.liveness_timeout_s:
                        self._declare_dead(now, part.key, peer, life)
                    if life.dead_at is not None and link.dead_at is None:
                        link.dead_at = life.dead_at
                        self._fail(req, part, CT.TIMEOUT, FailReason.PEER_DEAD)
                    dead_at = link.dead_at
                    ends = dead_at is not None and part.machine.accepts(CT.RANK_DEAD)
                    if ends and self._unquarantined(now, life, dead_at):  # type: ignore[arg-type]
                        part.machine.rank_ended(src, RankEnd.DEAD)
            if self._requests.get(req.transfer_id) is req:
                self._settle(now, req)

    def _unquarantined(self, now: float, life: PeerLife, dead_at: float) -> bool:
        """Whether blocks a dead P life may still write can go back: after the grace, once the life is
        confirmed (it spoke again, or a newer life answered), or at the quarantine bound (counted)."""
        cfg = self.config
        if now < dead_at + cfg.dead_peer_grace_s:
            return False
        if life.gone or life.last_msg > dead_at:
            return True
        if now < dead_at + cfg.dead_peer_grace_s + cfg.dead_quarantine_s:
            return False
        self.stats.quarantine_expired += 1
        self._log_warning(
            "P life %s unconfirmed %.0f s after it was declared dead: releasing its blocks",
            next((f"{e}/{i}" for (e, i), v in self._life.items() if v is life), "?"),
            now - dead_at,
        )
        return True

    def quarantined(self) -> int:
        """Requests whose blocks wait on a dead P life's confirmation (for /health and metrics)."""
        return sum(
            1
            for req in self._requests.values()
            if any(lk.dead_at is not None for part in req.parts.values() for lk in part.links.values())
        )

    def _declare_dead(self, now: float, key: RankKey, peer: PeerRank, life: PeerLife) -> None:
        silent = now - life.last_seen
        self._log_warning(
            "P %s/%s silent for %.1f s: declared dead", peer.engine_id, peer.incarnation, silent
        )
        life.dead_at = now
        self.stats.peers_declared_dead += 1
        self._do(ForgetPeer(peer.engine_id, peer.incarnation))
        # Ask its address who is there now: a refused connection (a killed process's socket is closed) or
        # a newer life confirms this one gone, so its blocks need not wait for the quarantine bound. A
        # timeout (frozen, partitioned) or the same life answering confirms nothing.
        token = self._new_token()
        self._probes[token] = (peer.engine_id, peer.incarnation)
        remote = (peer.pp_rank, peer.tp_rank)
        self._do(
            StartHandshake(token, key, peer.host, peer.port, remote, PeerMode.NOTIF_ONLY, peer.engine_id)
        )
