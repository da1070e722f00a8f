"""The consumer (D side): gets a request's KV into its blocks, by registration (push) or by reading (pull).

Engine call sites (any thread; none waits on the network):

* ``start() -> port``: registers every local rank's cache with its agent, starts the side channel.
* ``request_allocated(transfer_id, block_ids, num_tokens, num_cached_tokens, remote)``: D allocated the
  request's blocks (the same ids on every local rank, in token order, prefix-hit blocks included);
  ``remote`` names P (and, in pull mode, P's block ids).
* ``poll() -> list[ConsumerEvent]``: READY (decode may start), or FAILED then RELEASED, or (after
  ``abort``) RELEASED. After FAILED the blocks stay fenced until RELEASED.
* ``abort(transfer_id)``: the engine drops the request; RELEASED follows once no P rank can still write.
* ``close()``.

Push, per (request, local rank) a ``ConsumerRequest`` machine over the P ranks that rank needs
(``source_ranks``: every PP stage, the TP ranks holding its heads): a notif-only handshake with each,
then a ``push_reg``; ``done`` from every one makes it READY. A failure anywhere fails the request: FAILED
is reported at once, ``cancel`` goes to every rank still registered, and RELEASED comes when every P rank
has ended its registration (``done``, ``failed``, ``cancel_ack``) or was declared dead (silent past
``liveness_timeout_s``) and ``dead_peer_grace_s`` passed. D heartbeats every P rank it waits on (P's
lease) and P heartbeats back (its liveness).

Pull: a full handshake with each P rank, one READ per rank (coalesced descriptors), and once every read of
every local rank is done, ``done`` to each P rank (``failed`` after a failure or abort, once no read is in
flight), so P frees its blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Sequence

from kvwire.connector._base import ConnectorBase, RankKey
from kvwire.connector._consumer_state import Link, LocalPart, PeerLife, RemoteEngine, Request
from kvwire.connector.events import ConsumerEvent, ConsumerEventKind
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError, TransportError, UnexpectedSender
from kvwire.handshake.types import PeerRank
from kvwire.kv.descriptors import plan_transfer
from kvwire.kv.mapping import RankLayout, source_ranks
from kvwire.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    Notification,
    PushReg,
    TransferMode,
)
from kvwire.protocol.ranks import RankEnd
from kvwire.protocol.states import ConsumerEvent as CE
from kvwire.protocol.states import ConsumerRequest, ConsumerState
from kvwire.transport.base import PeerMode, XferOp, XferStatus

__all__ = ["Consumer", "RemoteEngine"]

log = logging.getLogger("kvwire.connector")

_DRAINING = (ConsumerState.FAILING, ConsumerState.CANCELLING)


class Consumer(ConnectorBase[ConsumerEvent]):
    """D side of kvwire for one engine and all its local ranks."""

    role = "consumer"

    def _setup(self) -> None:
        self._requests: dict[str, Request] = {}
        self._life: dict[tuple[str, str], PeerLife] = {}  # (engine_id, incarnation) of P engines
        self._reading: set[tuple[Request, Link, RankKey]] = set()
        self._layouts = {key: RankLayout.from_cache(r.cache) for key, r in self.ranks.items()}
        self._next_heartbeat = 0.0
        if self.engine.pp_size != 1:
            raise LayoutError("a consumer (D) engine runs with pp_size 1")

    def watched_peers(self) -> list[tuple[str, str]]:
        """(engine_id, incarnation) of the P lives whose liveness D tracks now (only those live requests
        wait on: the map is pruned at every heartbeat period)."""
        return list(self._life)

    # -- engine call sites -----------------------------------------------------------------------------
    def request_allocated(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        num_cached_tokens: int,
        remote: RemoteEngine,
    ) -> None:
        ids = [int(b) for b in block_ids]
        spec = self.engine.spec
        num_blocks = min(r.cache.num_blocks for r in self.ranks.values())
        if any(not 0 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise BlockRangeError(f"{transfer_id}: local block ids out of range or repeated")
        if num_tokens <= 0 or not 0 <= num_cached_tokens <= num_tokens or num_cached_tokens % spec.block_size:
            raise LayoutError(f"{transfer_id}: bad token counts {num_tokens}/{num_cached_tokens}")
        if len(ids) * spec.block_size < num_tokens:
            raise BlockRangeError(f"{transfer_id}: {len(ids)} blocks cannot hold {num_tokens} tokens")
        self._call(self._allocated, Request(transfer_id, ids, num_tokens, num_cached_tokens, remote))

    def abort(self, transfer_id: str) -> None:
        self._call(self._abort, transfer_id)

    # -- request lifecycle (loop thread) ---------------------------------------------------------------
    def _allocated(self, req: Request) -> None:
        if req.transfer_id in self._requests:
            log.warning("consumer: %s allocated twice; the second is ignored", req.transfer_id)
            return
        remote = req.remote
        try:
            for key in self.ranks:
                srcs = source_ranks(self.engine.spec, remote.tp_size, remote.pp_size, self._layouts[key])
                links = {src: Link(src) for src in srcs}
                req.parts[key] = LocalPart(key, ConsumerRequest(self.config.mode, srcs), links)
        except (LayoutError, UnexpectedSender) as exc:
            log.info(
                "consumer: %s cannot map P (tp %d, pp %d): %s",
                req.transfer_id,
                remote.tp_size,
                remote.pp_size,
                exc,
            )
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.FAILED, FailReason.INCOMPATIBLE))
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.RELEASED, FailReason.INCOMPATIBLE))
            return
        self._requests[req.transfer_id] = req
        mode = PeerMode.NOTIF_ONLY if self.config.mode is TransferMode.PUSH else PeerMode.FULL
        for part in req.parts.values():
            part.machine.handle(CE.REGISTER)
            for link in part.links.values():
                self._handshake(
                    part.key,
                    remote.host,
                    remote.port_of(link.src),
                    link.src,
                    mode,
                    functools.partial(self._on_p_handshake, req, part, link),
                    engine_id=remote.engine_id,
                )

    def _abort(self, transfer_id: str) -> None:
        req = self._requests.get(transfer_id)
        if req is None:
            return  # already READY or RELEASED: the blocks are the engine's
        req.aborted = True
        for part in req.parts.values():
            if part.machine.accepts(CE.CANCEL):
                part.machine.cancel()
        self._settle(req, self._clock())

    def _fail(self, req: Request, part: LocalPart, event: CE, reason: FailReason) -> None:
        req.reason = req.reason or reason
        self.stats.failures[reason] += 1
        if part.machine.accepts(event):
            part.machine.fail(event)

    def _settle(self, req: Request, now: float) -> None:
        """Spread a failure to every local part, drain, and report the request's end exactly once."""
        parts = list(req.parts.values())
        failed = any(p.machine.state in (ConsumerState.FAILING, ConsumerState.FAILED) for p in parts)
        if failed and not req.reported_failed and not req.aborted:
            req.reported_failed = True
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.FAILED, req.reason))
            for p in parts:
                if p.machine.state not in _DRAINING and p.machine.accepts(CE.CANCEL):
                    p.machine.cancel()
        pull = self.config.mode is TransferMode.PULL
        for p in parts:
            if p.machine.state not in _DRAINING:
                continue
            if pull:
                if not any(lk.handle is not None for lk in p.links.values()):
                    p.machine.handle(CE.ENDED_ALL)
                continue
            for src in p.machine.ranks.pending:
                link = p.links[src]
                if not link.cancel_sent and link.peer is not None:
                    link.cancel_sent = True
                    self._send(p.key, link.peer.agent_name, self._cancel_msg(req))
        states = {p.machine.state for p in parts}
        if states == {ConsumerState.READY}:
            if pull:
                self._tell_p(req, None)
            del self._requests[req.transfer_id]
            self.stats.transfers_done += 1
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.READY))
        elif all(p.machine.is_terminal for p in parts):
            if pull:
                self._tell_p(req, req.reason or FailReason.ABORTED)
            del self._requests[req.transfer_id]
            self._emit(ConsumerEvent(req.transfer_id, ConsumerEventKind.RELEASED, req.reason))

    def _cancel_msg(self, req: Request) -> Cancel:
        self.stats.cancels += 1
        return Cancel(
            transfer_id=req.transfer_id, engine_id=self.engine.engine_id, incarnation=self.engine.incarnation
        )

    # -- handshakes and registrations --------------------------------------------------------------------
    def _on_p_handshake(
        self, req: Request, part: LocalPart, link: Link, peer: PeerRank | None, exc: BaseException | None
    ) -> None:
        now = self._clock()
        if self._requests.get(req.transfer_id) is not req:
            return
        if peer is None:
            log.info("consumer: handshake with P %s for %s failed: %s", link.src, req.transfer_id, exc)
            self._fail(req, part, CE.HANDSHAKE_FAILED, FailReason.HANDSHAKE_FAILED)
        elif part.machine.state is ConsumerState.REGISTERING:
            link.peer = peer
            life = self._life.get((peer.engine_id, peer.incarnation))
            if life is None or life.dead_at is not None:
                # It just answered a handshake: alive again (a healed partition, a thawed process).
                # Links of the earlier life were all marked dead when it was declared, so they go on
                # to their grace period; this request must not inherit that verdict.
                life = self._life[(peer.engine_id, peer.incarnation)] = PeerLife(now)
            life.last_seen = max(life.last_seen, now)
            if self.config.mode is TransferMode.PUSH:
                self._register(req, part, link, peer, now)
            else:
                self._read(req, part, link, peer, now)
        self._settle(req, now)

    def _register(self, req: Request, part: LocalPart, link: Link, peer: PeerRank, now: float) -> None:
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
        if not self._send(part.key, peer.agent_name, reg):
            if not link.rehandshaked:
                # The cached entry may be of a P that restarted at the same address (NIXL #795): forget
                # that life of it and handshake again, once; the new life gets the registration.
                link.rehandshaked, link.peer = True, None
                self._forget_peer(peer.engine_id, peer.incarnation)
                self._handshake(
                    part.key,
                    req.remote.host,
                    req.remote.port_of(link.src),
                    link.src,
                    PeerMode.NOTIF_ONLY,
                    functools.partial(self._on_p_handshake, req, part, link),
                    engine_id=req.remote.engine_id,
                )
                return
            self._fail(req, part, CE.HANDSHAKE_FAILED, FailReason.HANDSHAKE_FAILED)
            return
        link.registered_at = now
        self.stats.transfers_started += 1
        part.machine.push_reg_sent(link.src)

    def _read(self, req: Request, part: LocalPart, link: Link, peer: PeerRank, now: float) -> None:
        assert peer.layout is not None
        try:
            plan = plan_transfer(
                self.engine.spec,
                peer.layout,
                self._layouts[part.key],
                list(req.remote.block_ids),
                req.block_ids,
                num_tokens=req.num_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        except (BlockRangeError, LayoutError) as exc:
            log.info("consumer: %s cannot read from %s: %s", req.transfer_id, peer.agent_name, exc)
            self._fail(req, part, CE.HANDSHAKE_FAILED, FailReason.BAD_REGISTRATION)
            return
        if plan.empty:
            link.read_done = True
        else:
            try:
                link.handle = self.ranks[part.key].agent.post(
                    XferOp.READ,
                    plan.dst_descs,
                    plan.src_descs,
                    peer.agent_name,
                    kind=self.ranks[part.key].cache.mem_kind,
                )
            except TransportError as exc:
                log.info("consumer: READ %s from %s not posted: %s", req.transfer_id, peer.agent_name, exc)
                self._fail(req, part, CE.HANDSHAKE_FAILED, FailReason.POST_FAILED)
                return
            link.posted_at = now
            self._reading.add((req, link, part.key))
            self.stats.transfers_started += 1
            self.stats.descriptors_posted += plan.num_descs
        if all(lk.handle is not None or lk.read_done for lk in part.links.values()):
            part.machine.handle(CE.READ_POSTED)
            self._reads_settled(part)

    def _reads_settled(self, part: LocalPart) -> None:
        if part.machine.state is ConsumerState.READING and all(lk.read_done for lk in part.links.values()):
            part.machine.handle(CE.DONE_ALL)

    def _tell_p(self, req: Request, reason: FailReason | None) -> None:
        """Pull: every read of the request is over; P may free its blocks."""
        for part in req.parts.values():
            for link in part.links.values():
                if link.peer is None:
                    continue
                common = {
                    "transfer_id": req.transfer_id,
                    "engine_id": self.engine.engine_id,
                    "incarnation": self.engine.incarnation,
                    "tp_rank": part.key[1],
                    "pp_rank": part.key[0],
                }
                msg: Notification = (
                    Done(num_blocks=len(req.remote.block_ids), **common)  # type: ignore[arg-type]
                    if reason is None
                    else Failed(reason=reason, **common)  # type: ignore[arg-type]
                )
                self._send(part.key, link.peer.agent_name, msg)

    # -- notifications ---------------------------------------------------------------------------------
    def _on_notif(self, key: RankKey, sender: str, msg: Notification, now: float) -> None:
        life = self._life.get((msg.engine_id, msg.incarnation))
        if life is not None:
            life.last_seen = max(life.last_seen, now)
        if isinstance(msg, Heartbeat):
            self._touch_peer(msg.engine_id)
            return
        if not isinstance(msg, Done | Failed | CancelAck) or self.config.mode is not TransferMode.PUSH:
            self._drop("unexpected", f"{type(msg).__name__} from {sender}")
            return
        req = self._requests.get(msg.transfer_id)
        part = None if req is None else req.parts.get(key)
        if req is None or part is None:
            self._drop("unknown_transfer", f"{type(msg).__name__} {msg.transfer_id} from {sender}")
            return
        src = (msg.pp_rank, msg.tp_rank)
        link = part.links.get(src)
        if link is None or link.peer is None or link.peer.agent_name != sender:
            stale = link is not None and link.peer is not None and link.peer.engine_id == msg.engine_id
            why = "stale_incarnation" if stale else "wrong_sender"
            self._drop(why, f"{type(msg).__name__} {msg.transfer_id} from {sender} as {src}")
            return
        if isinstance(msg, Done):
            how = RankEnd.DONE
        elif isinstance(msg, Failed):
            how = RankEnd.FAILED
            req.reason = req.reason or msg.reason
            self.stats.failures[msg.reason] += 1
        else:
            how = RankEnd.CANCEL_ACKED
        try:
            part.machine.rank_ended(src, how)
        except (IllegalTransition, UnexpectedSender) as exc:
            self._drop("late", f"{type(msg).__name__} {msg.transfer_id}: {exc}")
            return
        self._settle(req, now)

    # -- transfers and timers --------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._reading)

    def _poll_transfers(self, now: float) -> None:
        for item in list(self._reading):
            req, link, key = item
            handle = link.handle
            assert handle is not None
            polled = self._poll_xfer(key, handle, link.posted_at, now)
            if polled is None:
                continue
            state, timed_out = polled
            self._reading.discard(item)
            link.handle = None
            part = req.parts[key]
            if state is XferStatus.DONE:
                link.read_done = True
                self._reads_settled(part)
            else:
                reason = FailReason.TRANSFER_TIMEOUT if timed_out else FailReason.WRITE_FAILED
                event = CE.READ_FAILED if part.machine.accepts(CE.READ_FAILED) else CE.HANDSHAKE_FAILED
                self._fail(req, part, event, reason)
            if self._requests.get(req.transfer_id) is req:
                self._settle(req, now)

    def _timers(self, now: float) -> None:
        if self.config.mode is TransferMode.PUSH:
            self._check_liveness(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._heartbeats()
            self._reap({req.remote.engine_id for req in self._requests.values()})
            self._prune_life()

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
                    if (
                        life.dead_at is None
                        and now - max(life.last_seen, link.registered_at) > cfg.liveness_timeout_s
                    ):
                        self._declare_dead(peer, life, now)
                    if life.dead_at is not None and link.dead_at is None:
                        link.dead_at = life.dead_at
                        self._fail(req, part, CE.TIMEOUT, FailReason.PEER_DEAD)
                    if link.dead_at is not None and now >= link.dead_at + cfg.dead_peer_grace_s:
                        with contextlib.suppress(IllegalTransition, UnexpectedSender):
                            part.machine.rank_ended(src, RankEnd.DEAD)
            if self._requests.get(req.transfer_id) is req:
                self._settle(req, now)

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

    def _declare_dead(self, peer: PeerRank, life: PeerLife, now: float) -> None:
        log.warning(
            "consumer: P %s/%s silent for %.1f s: declared dead",
            peer.engine_id,
            peer.incarnation,
            now - life.last_seen,
        )
        life.dead_at = now
        self.stats.peers_declared_dead += 1
        self._forget_peer(peer.engine_id, peer.incarnation)

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
            if self._send(key, agent_name, hb):
                self.stats.heartbeats_sent += 1

    def _on_shutdown(self) -> None:
        now = self._clock()
        for req in list(self._requests.values()):
            req.aborted = True
            for part in req.parts.values():
                if part.machine.accepts(CE.CANCEL):
                    part.machine.cancel()
            self._settle(req, now)
