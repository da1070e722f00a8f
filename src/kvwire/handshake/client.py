"""The side-channel client: one attempt at fetching a remote rank's metadata.

Retries, deduplication and caching live in ``HandshakeManager``; this module does one connection and
translates everything that can go wrong into ``kvwire.errors`` types:

* ``PeerUnreachable``: refused, reset, or closed before replying (worth retrying);
* ``HandshakeTimeout``: no complete answer before the deadline;
* ``IncompatiblePeer`` / ``Unauthorized`` / ``NoSuchRank``: the peer refused, or its reply does not match
  (compat hash, version, rank; with a secret, a reply that is not sealed for this request); retrying will
  not help;
* ``HandshakeError``: the peer's reply is not a valid frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwire.errors import (
    AuthError,
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    NobodyListens,
    NoSuchRank,
    PeerUnreachable,
    ProtocolError,
    Unauthorized,
    VersionMismatch,
)
from kvwire.handshake import refusals
from kvwire.handshake.types import PeerAddress

if TYPE_CHECKING:
    from kvwire.handshake.lines import ClaimLines
from kvwire.protocol.auth import SignedRequest, sign
from kvwire.protocol.codec import FRAME_HEADER_BYTES, decode_side, encode_frame, parse_frame_header
from kvwire.protocol.compat import describe_mismatch, fields_of
from kvwire.protocol.messages import (
    VERSION,
    Ack,
    Claim,
    ErrorCode,
    ErrorReply,
    GetMetadata,
    Granted,
    Metadata,
    ReportFailed,
    Sealed,
    SideMessage,
)
from kvwire.protocol.seal import ReplySeal

# A timeout that fires this long past its deadline means this process's event loop was stalled then: the
# peer's answer may have arrived and been left unread, because the timeout's callback runs before the
# read it cancels. The loop's timers are late by about a millisecond otherwise.
_STALLED_S = 0.25

_REFUSALS: dict[ErrorCode, type[HandshakeError]] = {
    ErrorCode.INCOMPATIBLE: IncompatiblePeer,
    ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.NO_SUCH_RANK: NoSuchRank,
    ErrorCode.BAD_REQUEST: HandshakeError,
    ErrorCode.GONE: HandshakeError,
    ErrorCode.NOT_YET: HandshakeError,
}


@dataclass(frozen=True, slots=True)
class Fetched:
    """A checked ``metadata`` reply, with the clock offset of the lowest-RTT sample."""

    metadata: Metadata
    clock_offset_s: float
    rtt_s: float


async def fetch_metadata(
    addr: PeerAddress,
    *,
    notif_only: bool,
    compat_hash: str,
    timeout_s: float,
    secret: bytes | None = None,
    clock_samples: int = 1,
    clock_rtt_target_s: float = 0.0,
) -> Fetched:
    """Fetch ``addr``'s metadata over one connection, within ``timeout_s``.

    Every reply gives a clock offset estimate ``server_time - midpoint``, wrong by at most half its round
    trip. While the best round trip is above ``clock_rtt_target_s``, up to ``clock_samples - 1`` extra
    notif-only requests follow on the same connection, and the lowest-RTT sample wins: on a quiet link
    the first reply is precise enough, and the handshake pays no extra round trips.
    """
    async with _connection(addr, timeout_s) as (reader, writer):
        first, rtt, offset = await _request(reader, writer, addr, notif_only, secret)
        _check(first, addr, compat_hash, notif_only)
        for _ in range(max(1, clock_samples) - 1):
            if rtt <= clock_rtt_target_s:
                break
            sample, s_rtt, s_offset = await _request(reader, writer, addr, True, secret)
            _check(sample, addr, compat_hash, True)
            if s_rtt < rtt:
                rtt, offset = s_rtt, s_offset
        return Fetched(first, offset, rtt)


@contextlib.asynccontextmanager
async def _connection(
    addr: PeerAddress, timeout_s: float
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """One connection to ``addr``, all its use within ``timeout_s``, closed after; the network's failures
    as ``kvwire.errors`` (what the body raises itself passes as it is)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    ended = math.inf  # when the body stopped (the timeout's cancel reached it), before the close
    try:
        async with asyncio.timeout_at(deadline):
            reader, writer = await open_stream(addr)
            try:
                yield reader, writer
            finally:
                ended = loop.time()
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        late = _stalled(min(ended, loop.time()) - deadline)
        raise HandshakeTimeout(f"{addr}: no answer within {timeout_s:.3g} s{late}") from None
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise network_error(addr, exc) from None


async def open_stream(addr: PeerAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to ``addr``'s side channel; a host no resolver takes (a NUL; a 64-character
    label: UnicodeError) or a port past 65535 (OverflowError) as ``PeerUnreachable``."""
    try:
        return await asyncio.open_connection(addr.host, addr.port)
    except (ValueError, OverflowError) as exc:
        raise PeerUnreachable(f"{addr}: bad host or port: {type(exc).__name__}: {exc}") from None


def network_error(addr: PeerAddress, exc: OSError | asyncio.IncompleteReadError) -> HandshakeError:
    """A connection's failure as ``kvwire.errors``: nobody listening (refused), else unreachable."""
    if isinstance(exc, ConnectionRefusedError):
        return NobodyListens(f"{addr}: {type(exc).__name__}: {exc}")
    return PeerUnreachable(f"{addr}: {type(exc).__name__}: {exc}")


def _stalled(late_s: float) -> str:
    """What to add to a timeout's message when it fired ``late_s`` past its deadline: nothing, or that
    this side's loop was stalled (so the fault may be here, not at the peer)."""
    if late_s < _STALLED_S:
        return ""
    return (
        f" (the timeout fired {late_s:.2f} s late: this process's event loop was stalled, so an answer may "
        "have come unread; look for a thread holding the GIL or a CPU this process cannot get)"
    )


async def roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, addr: PeerAddress, msg: SideMessage
) -> SideMessage:
    """Send one frame and read the one that answers it; a reply that does not decode as ``HandshakeError``
    (a newer wire version: ``IncompatiblePeer``)."""
    writer.write(encode_frame(msg))
    await writer.drain()
    try:
        header = await reader.readexactly(FRAME_HEADER_BYTES)
        return decode_side(await reader.readexactly(parse_frame_header(header)))
    except VersionMismatch as exc:
        raise IncompatiblePeer(f"{addr}: {exc}") from None
    except ProtocolError as exc:
        raise HandshakeError(f"{addr}: bad reply: {exc}") from None


async def _request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    addr: PeerAddress,
    notif_only: bool,
    secret: bytes | None,
) -> tuple[Metadata, float, float]:
    req = GetMetadata(pp_rank=addr.pp_rank, tp_rank=addr.tp_rank, notif_only=notif_only)
    if secret:
        req = sign(req, secret, target=f"{addr.host}:{addr.port}")
    sent_wall, sent = time.time(), time.perf_counter()
    reply = await roundtrip(reader, writer, addr, req)
    rtt = time.perf_counter() - sent
    reply = opened_reply(reply, req, secret, addr)
    if isinstance(reply, ErrorReply):
        raise _REFUSALS[reply.code](f"{addr} refused: {reply.code.value}: {reply.message}")
    if not isinstance(reply, Metadata):
        raise HandshakeError(f"{addr}: bad reply: {type(reply).__name__} is no reply")
    return reply, rtt, reply.server_time - (sent_wall + rtt / 2)


async def send_report(
    addr: PeerAddress, report: ReportFailed, *, timeout_s: float, secret: bytes | None = None
) -> None:
    """Deliver one ``report_failed`` to ``addr`` (D's side channel, its rank in ``addr``) within
    ``timeout_s``; raises as ``fetch_metadata`` does, or the peer's refusal."""
    if secret:
        report = sign(report, secret, target=f"{addr.host}:{addr.port}")
    async with _connection(addr, timeout_s) as (reader, writer):
        reply = opened_reply(await roundtrip(reader, writer, addr, report), report, secret, addr)
    if isinstance(reply, ErrorReply):
        raise _REFUSALS[reply.code](f"{addr} refused: {reply.code.value}: {reply.message}")
    if not isinstance(reply, Ack):
        raise HandshakeError(f"{addr}: bad reply: {type(reply).__name__} is no ack")


async def send_claim(
    addr: PeerAddress,
    claim: Claim,
    *,
    timeout_s: float,
    secret: bytes | None = None,
    lines: ClaimLines | None = None,
) -> Granted | ErrorReply:
    """Ask P (its rank in ``addr``) whether it still holds a pull request's blocks: its ``granted``, or
    its refusal as the ``ErrorReply`` (``gone``, ``bad_request``, ...); raises as ``fetch_metadata`` does
    when no trusted answer comes (under a secret only a sealed ``granted`` is believed). ``lines``: on
    its kept connections (``handshake/lines.py``), else on a connection of its own."""
    if lines is not None:
        raw, sent = await lines.send(addr, claim, timeout_s=timeout_s, secret=secret)
        reply = opened_reply(raw, sent, secret, addr)
    else:
        if secret:
            claim = sign(claim, secret, target=f"{addr.host}:{addr.port}")
        async with _connection(addr, timeout_s) as (reader, writer):
            reply = opened_reply(await roundtrip(reader, writer, addr, claim), claim, secret, addr)
    if not isinstance(reply, Granted | ErrorReply):
        raise HandshakeError(f"{addr}: bad reply: {type(reply).__name__} answers no claim")
    return reply


# Refusals a server with a secret sends plain: of a request it could not verify, or could not decode.
_PLAIN_REFUSALS = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST, ErrorCode.INCOMPATIBLE})


@functools.lru_cache(maxsize=8)
def _reply_seal(secret: bytes) -> ReplySeal:
    return ReplySeal(secret)


def opened_reply(
    reply: SideMessage, req: SignedRequest, secret: bytes | None, addr: PeerAddress
) -> SideMessage:
    """The reply a holder of the secret can trust: with a secret, metadata only from a ``Sealed`` reply
    made for ``req`` (a relay or an impostor answering on the peer's address cannot make one). A plain
    refusal of our credentials or of an undecodable request passes (the server cannot seal it, and it
    grants nothing); any other refusal must come sealed."""
    if not secret:
        if isinstance(reply, Sealed):
            raise Unauthorized(f"{addr}: the peer seals its replies (it has a KVWIRE_SECRET, this side none)")
        return reply
    if isinstance(reply, ErrorReply | Ack):  # an ack grants nothing: it goes plain
        if (
            isinstance(reply, ErrorReply) and reply.code not in _PLAIN_REFUSALS
        ):  # the server seals these: a plain one is not its own
            detail = f"unsealed {reply.code.value} refusal: not from a holder of the secret"
            raise Unauthorized(f"{addr}: {detail}")
        return reply
    if not isinstance(reply, Sealed):
        raise Unauthorized(
            f"{addr}: {type(reply).__name__} reply is not sealed: the peer has no KVWIRE_SECRET, or is "
            "not the engine it claims"
        )
    try:
        inner = decode_side(_reply_seal(secret).open(reply, req))
    except AuthError as exc:
        raise Unauthorized(f"{addr}: {exc}") from None
    except ProtocolError as exc:
        raise HandshakeError(f"{addr}: bad sealed reply: {exc}") from None
    if isinstance(inner, Sealed):
        raise HandshakeError(f"{addr}: bad sealed reply: a sealed reply inside another")
    return inner


def _check(md: Metadata, addr: PeerAddress, compat_hash: str, notif_only: bool) -> None:
    if md.version != VERSION:
        raise IncompatiblePeer(f"{addr}: wire version {md.version}, this side speaks {VERSION}")
    if md.compat_hash != compat_hash:
        detail = refusals.clip(f"compat hash differs: {_mismatch(md, compat_hash)}")
        refusals.record(addr.host, addr.port, detail)
        raise IncompatiblePeer(f"{addr} ({refusals.clip(md.engine_id)}): {detail}")
    refusals.clear(addr.host, addr.port)
    if (md.pp_rank, md.tp_rank) != (addr.pp_rank, addr.tp_rank):
        raise HandshakeError(f"{addr}: answered for rank pp{md.pp_rank}/tp{md.tp_rank}")
    if not notif_only and md.notif_only:
        raise HandshakeError(f"{addr}: answered a full request with notif-only metadata")


def _mismatch(md: Metadata, compat_hash: str) -> str:
    """What differs, field by field when both sides' fields are known (a peer that predates
    ``Metadata.compat`` sends only its hash)."""
    ours = fields_of(compat_hash)
    if ours is None or md.compat is None:
        return f"{md.compat_hash} at the peer, {compat_hash} here"
    return describe_mismatch(ours, md.compat, "the peer")
