"""D's pull core: a full handshake with each P rank, one READ per rank (coalesced descriptors), and once
every read of every local rank is over, ``done`` to each P rank (``failed`` after a failure or an abort,
once no read is in flight), so P frees its blocks. D's own READs land in D's blocks, so posted reads are
drained like P's writes in push: a draining part ends only when no READ of it is in flight."""

from __future__ import annotations

from kvwire.core.consumer import ConsumerCore
from kvwire.core.consumer_records import Link, LocalPart, Request
from kvwire.core.io import ClaimAnswered, Input, Outcome, PostRead, Release, SendClaim, XferEnded
from kvwire.core.types import PeerRank
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError
from kvwire.kv.descriptors import TransferPlan, plan_transfer
from kvwire.protocol.messages import Claim, Done, Failed, FailReason, Notification
from kvwire.protocol.states import ConsumerState
from kvwire.protocol.states import ConsumerTrigger as CT
from kvwire.protocol.types import PeerMode


class PullConsumerCore(ConsumerCore):
    peer_mode = PeerMode.FULL

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._posting: dict[int, tuple[Request, LocalPart, Link, int]] = {}
        self._reading: dict[int, tuple[Request, LocalPart, Link, int]] = {}
        self._claims: dict[int, tuple[Request, LocalPart, Link, TransferPlan, float]] = {}  # out, by token

    @property
    def busy(self) -> bool:
        return bool(self._reading)

    def _start(self, now: float, req: Request, part: LocalPart, link: Link, peer: PeerRank) -> None:
        """Claim P's blocks for this request before reading them: a P that no longer holds them (its
        lease ran out while D waited) refuses, and nothing is read."""
        assert peer.layout is not None
        try:
            plan = plan_transfer(
                self.engine.spec,
                peer.layout,
                self.layouts[part.key],
                list(req.remote.block_ids),
                req.block_ids,
                num_tokens=req.num_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        except (BlockRangeError, LayoutError) as exc:
            self._log_info("%s cannot read from %s: %s", req.transfer_id, peer.agent_name, exc)
            self._fail(req, part, CT.HANDSHAKE_FAILED, FailReason.BAD_REGISTRATION)
            # P holds the prompt's blocks for this request though nothing will be claimed: told now, it
            # frees them at once rather than at its lease (a link never claimed is not told at the end).
            self._tell(req, part, link, FailReason.BAD_REGISTRATION)
            return
        if plan.empty:
            link.read_done = True
            self._posted(part)
            return
        token = self._new_token()
        link.claiming = True
        self._claims[token] = (req, part, link, plan, now)
        claim = Claim(
            pp_rank=peer.pp_rank,
            tp_rank=peer.tp_rank,
            to_incarnation=peer.incarnation,
            transfer_id=req.transfer_id,
            block_ids=list(req.remote.block_ids),
            engine_id=self.engine.engine_id,
            incarnation=self.engine.incarnation,
            from_pp_rank=part.key[0],
            from_tp_rank=part.key[1],
            tp_size=self.engine.tp_size,
            idle_ranks=True,
        )
        self._do(SendClaim(token, part.key, peer.host, peer.port, link.src, claim))

    def _claim_answered(self, now: float, inp: ClaimAnswered) -> None:
        req, part, link, plan, sent_at = self._claims.pop(inp.token)
        link.claiming = False
        if (
            part.machine.state is not ConsumerState.REGISTERING
            or self._requests.get(req.transfer_id) is not req
        ):
            # Ended meanwhile (an abort, a dead P, another read failed): nothing is read. P holds the
            # blocks for us now, or may (no trusted answer): it hears our end with the others' once our
            # reads drained, or at once when they already did (it may have taken a word before this).
            if _maybe_granted(inp):
                link.claimed = True
                if self._requests.get(req.transfer_id) is not req:
                    self._tell(req, part, link, FailReason.ABORTED)
            return
        if inp.lease_s is None:
            why = inp.refusal or FailReason.HANDSHAKE_FAILED
            # No trusted answer (a timeout, a lost reply): P may have granted it all the same, so it hears
            # our end with the others (a ``failed`` for a hold it never granted changes nothing there).
            link.claimed = _maybe_granted(inp)
            self._log_info("%s: P refused the claim (%s): %s", req.transfer_id, why.value, inp.detail)
            self._fail(req, part, CT.HANDSHAKE_FAILED, why)
            self._settle(now, req)
            return
        link.claimed, link.claim_until = True, sent_at + inp.lease_s
        token = self._new_token()
        link.posting, link.posted_at = True, now
        self._posting[token] = (req, part, link, plan.nbytes)
        self.stats.descriptors_posted += plan.num_descs
        assert link.peer is not None
        self._do(
            PostRead(
                token,
                part.key,
                link.peer.agent_name,
                plan.src_array,
                plan.dst_array,
                plan.nbytes,
                req.transfer_id,
            )
        )

    def _on_outcome(self, now: float, inp: Outcome) -> None:
        req, part, link, nbytes = self._posting.pop(inp.token)
        link.posting = False
        if inp.ok:
            link.token = inp.token
            self._reading[inp.token] = (req, part, link, nbytes)
            self.stats.transfers_started += 1
            self._posted(part)
        else:
            self._log_info("READ %s not posted: %s", req.transfer_id, inp.detail)
            # NIXL may have issued part of a READ whose post then failed: its blocks wait the grace too.
            req.hold_until = max(req.hold_until, now + self.config.dead_peer_grace_s)
            self._fail(req, part, CT.HANDSHAKE_FAILED, FailReason.POST_FAILED)
        self._settle(now, req)

    def _posted(self, part: LocalPart) -> None:
        if part.machine.state is not ConsumerState.REGISTERING:
            return
        if all(lk.token or lk.read_done for lk in part.links.values()):
            part.machine.handle(CT.READ_POSTED)
            self._reads_settled(part)

    def _reads_settled(self, part: LocalPart) -> None:
        if part.machine.state is ConsumerState.READING and all(lk.read_done for lk in part.links.values()):
            part.machine.handle(CT.DONE_ALL)

    def _on_transfer_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, ClaimAnswered):
            self._claim_answered(now, inp)
            return
        if not isinstance(inp, XferEnded):
            raise IllegalTransition(self.role, "pull", type(inp).__name__)
        req, part, link, nbytes = self._reading.pop(inp.token)
        self._do(Release(inp.token))
        self._read_ended(now, req, part, link, ok=inp.ok, nbytes=nbytes, reason=FailReason.WRITE_FAILED)

    def _read_ended(
        self,
        now: float,
        req: Request,
        part: LocalPart,
        link: Link,
        *,
        ok: bool,
        nbytes: int,
        reason: FailReason,
    ) -> None:
        link.token = 0
        if ok and now > link.claim_until:
            # P's grant ran out before the read ended: P may have reused the blocks mid-read.
            ok, reason = False, FailReason.LEASE_EXPIRED
        if ok:
            link.read_done = True
            self.stats.bytes_moved += nbytes
            self.stats.record_duration(now - link.posted_at)
            self._reads_settled(part)
        else:
            # A read released before it completed may still drain into the blocks (as a write P recalls:
            # ``consumer_liveness.drain_hold``): they wait the grace before the engine reuses them.
            req.hold_until = max(req.hold_until, now + self.config.dead_peer_grace_s)
            event = CT.READ_FAILED if part.machine.accepts(CT.READ_FAILED) else CT.HANDSHAKE_FAILED
            self._fail(req, part, event, reason)
        if self._requests.get(req.transfer_id) is req:
            self._settle(now, req)

    def _timers(self, now: float) -> None:
        timeout = self.config.transfer_timeout_s
        for token, (req, part, link, nbytes) in list(self._reading.items()):
            if now - link.posted_at > timeout:
                del self._reading[token]
                self._do(Release(token))
                self._read_ended(
                    now, req, part, link, ok=False, nbytes=nbytes, reason=FailReason.TRANSFER_TIMEOUT
                )
        super()._timers(now)

    def _drain(self, req: Request, part: LocalPart) -> None:
        if not any(lk.token or lk.posting for lk in part.links.values()):
            part.machine.handle(CT.ENDED_ALL)

    def _ended(self, req: Request, reason: FailReason | None) -> None:
        """Every read of the request is over: P may free its blocks."""
        for part in req.parts.values():
            for link in part.links.values():
                # Not to a P rank that refused the claim, nor one never asked: it holds nothing for us.
                if link.claimed or link.claiming or link.read_done:
                    self._tell(req, part, link, reason)

    def _tell(self, req: Request, part: LocalPart, link: Link, reason: FailReason | None) -> None:
        if link.peer is None:
            return
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


def _maybe_granted(answer: ClaimAnswered) -> bool:
    """P granted the claim, or may have: no trusted answer came (a refusal says it holds nothing for us)."""
    return answer.lease_s is not None or answer.refusal in (None, FailReason.HANDSHAKE_FAILED)
