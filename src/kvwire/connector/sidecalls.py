"""The side-channel calls a connector's driver makes for its core, and answers for it: handshakes
(``StartHandshake`` -> ``HandshakeDone``), pull mode's claims (D: ``SendClaim`` -> ``ClaimAnswered``;
P: a ``claim`` on the side channel -> ``ClaimArrived`` -> ``AnswerClaim``). Each runs on the connector's
loop; what comes back enters the core as an input (``_guarded``), never re-entrantly."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from kvwire.core.handshake import refusal
from kvwire.core.io import AnswerClaim, ClaimAnswered, ClaimArrived, HandshakeDone, SendClaim, StartHandshake
from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import KvwireError, NobodyListens
from kvwire.handshake.client import send_claim
from kvwire.handshake.lines import ClaimLines, claim_timeout
from kvwire.handshake.server import ClaimVerdict
from kvwire.protocol.messages import Claim, ErrorCode, ErrorReply, FailReason, Granted

if TYPE_CHECKING:
    from kvwire.connector._base import ConnectorBase

log = logging.getLogger("kvwire.connector")
CLAIM_RETRY_S = 0.02  # the first pause before a claim P answered ``not_yet`` is asked again (doubling)

# How D fails a request whose claim P refused.
CLAIM_REFUSALS = {
    ErrorCode.GONE: FailReason.LEASE_EXPIRED,
    ErrorCode.NOT_YET: FailReason.LEASE_EXPIRED,  # not finished there within the claim's budget
    ErrorCode.BAD_REQUEST: FailReason.BAD_REGISTRATION,
    ErrorCode.INCOMPATIBLE: FailReason.INCOMPATIBLE,
    ErrorCode.UNAUTHORIZED: FailReason.UNAUTHORIZED,
}


def start_handshake(conn: ConnectorBase[Any], a: StartHandshake) -> None:
    """Run ``ensure`` on the loop; its ``HandshakeDone`` comes back as an input when it ends."""
    mgr = conn.managers[a.key]
    args = (a.host, a.port, a.remote[0], a.remote[1], a.mode)
    try:
        hit = mgr.cached(*args, engine_id=a.engine_id, incarnation=a.incarnation)
    except KvwireError as exc:
        refused = isinstance(exc, NobodyListens)
        conn._feeder.follow(HandshakeDone(a.token, None, str(exc), refusal(exc), refused))
        return
    if hit is not None:
        # Cached (the usual case): answered right after the input that asked, as an outcome is (never
        # re-entrantly), not a loop pass later: that pass cost each rank pair a wake-up.
        conn._feeder.follow(HandshakeDone(a.token, hit, "", cached=True))
        return
    task = asyncio.ensure_future(mgr.ensure(*args, engine_id=a.engine_id, incarnation=a.incarnation))

    def finished(t: asyncio.Future[PeerRank]) -> HandshakeDone:
        exc = t.exception()
        if exc is not None and not isinstance(exc, KvwireError):
            log.error("%s: handshake with %s:%d raised %r", conn.role, a.host, a.port, exc)
        if exc is not None:
            return HandshakeDone(a.token, None, str(exc), refusal(exc), isinstance(exc, NobodyListens))
        return HandshakeDone(a.token, t.result(), "")

    _follow_up(conn, task, finished)


def start_claim(conn: ConnectorBase[Any], a: SendClaim) -> None:
    """D: send the claim on P's side channel; P's answer (or why none came) returns as ``ClaimAnswered``."""
    addr = PeerAddress(a.host, a.port, a.remote[0], a.remote[1])
    if conn._claim_lines is None:
        conn._claim_lines = ClaimLines()
    task = asyncio.ensure_future(
        claim_until_finished(addr, a.claim, conn.config.handshake_timeout_s, conn._secret, conn._claim_lines)
    )

    def finished(t: asyncio.Future[Granted | ErrorReply]) -> ClaimAnswered:
        exc = t.exception()
        if exc is not None:
            # No trusted answer: nothing says P holds the blocks, so nothing is read.
            return ClaimAnswered(a.token, None, FailReason.HANDSHAKE_FAILED, f"{type(exc).__name__}: {exc}")
        reply = t.result()
        if isinstance(reply, Granted):
            return ClaimAnswered(a.token, reply.lease_ms / 1e3)
        why = CLAIM_REFUSALS.get(reply.code, FailReason.HANDSHAKE_FAILED)
        return ClaimAnswered(a.token, None, why, f"{reply.code.value}: {reply.message}")

    _follow_up(conn, task, finished)


async def claim_until_finished(
    addr: PeerAddress, claim: Claim, budget_s: float, secret: bytes | None, lines: ClaimLines | None = None
) -> Granted | ErrorReply:
    """The claim, asked again while P answers ``not_yet`` (P's worker gets a request's end a step after
    P's answer left: with PP on P a later stage's even later), for up to ``budget_s`` in all. The core's
    grant window counts from the first try: later tries only make it safer. A try the budget cut short
    raises (P may have granted it: D then tells it ``failed``); a pause it cut short leaves ``not_yet``."""
    pause, reply, asking = CLAIM_RETRY_S, None, False
    try:
        async with asyncio.timeout(budget_s):
            while True:
                asking = True
                reply = await send_claim(addr, claim, timeout_s=budget_s, secret=secret, lines=lines)
                asking = False
                if not isinstance(reply, ErrorReply) or reply.code is not ErrorCode.NOT_YET:
                    return reply
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
    except TimeoutError:
        if asking or reply is None:
            # This budget fires before the try's own (same length, started first): asyncio's bare
            # TimeoutError named no address, and D logged "P refused the claim: TimeoutError: ".
            raise claim_timeout(addr, budget_s) from None
        return reply


def _follow_up(conn: ConnectorBase[Any], task: asyncio.Future[Any], answer: Any) -> None:
    """When ``task`` ends, feed ``answer(task)`` (an input) to the core on the loop, then wake it."""
    conn._tasks.add(task)

    def done(t: asyncio.Future[Any]) -> None:
        conn._tasks.discard(t)
        if t.cancelled():
            return
        conn._guarded(conn._apply, (conn._clock(), answer(t)))
        conn._wake()

    task.add_done_callback(done)


def answer_claim(conn: ConnectorBase[Any], claim: Claim) -> ClaimVerdict:
    """P: judge an authenticated claim now (side channel, same loop): the core's ``AnswerClaim``."""
    token = conn._new_claim_token()
    conn._guarded(conn._apply, (conn._clock(), ClaimArrived(token, claim)))
    conn._wake()
    verdict: AnswerClaim | None = conn._claim_verdicts.pop(token, None)
    if verdict is None:  # the core failed on it (logged): nothing says it holds the blocks
        return ErrorCode.GONE, f"{claim.transfer_id}: not judged"
    if verdict.lease_s is not None:
        return Granted(lease_ms=max(1, int(verdict.lease_s * 1e3)))
    return verdict.code or ErrorCode.GONE, verdict.detail
