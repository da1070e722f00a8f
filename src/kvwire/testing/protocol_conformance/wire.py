"""The kit's side of the side channel: raw frames out, decoded answers back, nothing assumed of the peer.

Every exchange opens its own connection, sends whole frames (or a bare header, for the oversized-frame
check) and reads one answer per frame; an answer is a decoded message, ``CLOSED`` (the peer closed the
connection) or ``SILENT`` (nothing within the timeout). The kit builds requests with kvwire's codec and
signer, which implement docs/protocol.md §1-§4 (the checks it runs are against that text, not against
kvwire's behaviour), and builds bad frames by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from kvwire.errors import AuthError, ProtocolError
from kvwire.protocol.auth import sign
from kvwire.protocol.codec import FRAME_HEADER_BYTES, decode_side, encode_frame, parse_frame_header
from kvwire.protocol.messages import (
    ErrorCode,
    ErrorReply,
    FailReason,
    GetMetadata,
    Metadata,
    ReportFailed,
    Sealed,
    SideMessage,
)
from kvwire.protocol.seal import ReplySeal


class Silence(enum.Enum):
    CLOSED = "the peer closed the connection"
    SILENT = "no answer within the timeout"


Answer = SideMessage | Silence


class CheckFailed(Exception):
    """A check's verdict: the peer did not do what docs/protocol.md says (the message says what)."""


@dataclass(frozen=True)
class Target:
    """The implementation under test: its side channel, the rank asked for, and the cluster's secret."""

    host: str
    port: int
    secret: bytes | None = None
    pp_rank: int = 0
    tp_rank: int = 0
    timeout_s: float = 5.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def raw_frame(obj: object) -> bytes:
    """Any msgpack value as one frame, whatever it holds (bad requests are built so)."""
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


R = TypeVar("R", GetMetadata, ReportFailed)


def signed(target: Target, msg: R, *, at: str | None = None, now_ms: int | None = None) -> R:
    """``msg`` signed for ``at`` (default: the target's address) when the cluster has a secret."""
    if target.secret is None:
        return msg
    return sign(msg, target.secret, target=at or target.address, now_ms=now_ms)


def metadata_request(
    target: Target, *, notif_only: bool = False, at: str | None = None, now_ms: int | None = None
) -> GetMetadata:
    req = GetMetadata(pp_rank=target.pp_rank, tp_rank=target.tp_rank, notif_only=notif_only)
    return signed(target, req, at=at, now_ms=now_ms)


@contextlib.asynccontextmanager
async def connection(target: Target) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    try:
        async with asyncio.timeout(target.timeout_s):
            reader, writer = await asyncio.open_connection(target.host, target.port)
    except (OSError, TimeoutError) as exc:
        raise CheckFailed(f"cannot connect to {target.address}: {exc!r}") from None
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await writer.wait_closed()


async def read_answer(reader: asyncio.StreamReader, timeout_s: float) -> Answer:
    """One frame from the peer, decoded; a frame that does not decode fails the check."""
    try:
        async with asyncio.timeout(timeout_s):
            header = await reader.readexactly(FRAME_HEADER_BYTES)
            body = await reader.readexactly(parse_frame_header(header))
    except TimeoutError:
        return Silence.SILENT
    except (asyncio.IncompleteReadError, ConnectionError):
        return Silence.CLOSED
    except ProtocolError as exc:
        raise CheckFailed(f"the peer sent a bad frame header: {exc}") from None
    try:
        return decode_side(body)
    except ProtocolError as exc:
        raise CheckFailed(f"the peer's answer does not decode: {exc}") from None


async def exchange(
    target: Target, frames: Sequence[bytes], *, then_eof: bool = False, stop_at_silence: bool = False
) -> list[Answer]:
    """Send each frame on one connection and read one answer per frame; ``then_eof``: one more read, to
    see whether the peer closed the connection after the last answer; ``stop_at_silence``: no frame more
    after the first that got no answer (a silent peer costs one timeout, not one per frame)."""
    answers: list[Answer] = []
    async with connection(target) as (reader, writer):
        for frame in frames:
            try:
                writer.write(frame)
                await writer.drain()
            except ConnectionError:
                answers.append(Silence.CLOSED)
                if stop_at_silence:
                    return answers
                continue
            answers.append(await read_answer(reader, target.timeout_s))
            if stop_at_silence and isinstance(answers[-1], Silence):
                return answers
        if then_eof:
            answers.append(await read_answer(reader, target.timeout_s))
    return answers


async def ask(target: Target, msg: GetMetadata | ReportFailed) -> Answer:
    """One request, one answer, on its own connection."""
    return (await exchange(target, [encode_frame(msg)]))[0]


def describe(answer: Answer) -> str:
    if isinstance(answer, Silence):
        return answer.value
    if isinstance(answer, ErrorReply):
        return f"error {answer.code.value} ({answer.message[:160]})"
    return type(answer).__name__


def opened(target: Target, answer: Answer, req: GetMetadata | ReportFailed) -> tuple[SideMessage, bool]:
    """The answer as the requester may trust it (§4), and whether it came sealed. With a secret only a
    ``sealed`` answer made for ``req`` carries anything but ``unauthorized``/``bad_request``/
    ``incompatible`` refusals or an ``ack``; without one a sealed answer is wrong."""
    if isinstance(answer, Silence):
        raise CheckFailed(f"no answer: {answer.value}")
    if not isinstance(answer, Sealed):
        return answer, False
    if target.secret is None:
        raise CheckFailed("a sealed answer, but the kit was given no secret (a secret on one side only?)")
    if not isinstance(req.nonce, bytes) or req.target is None:
        raise CheckFailed("a sealed answer to an unsigned request")
    try:
        inner = decode_side(ReplySeal(target.secret).open(answer, req))
    except AuthError as exc:
        raise CheckFailed(f"the sealed answer does not open for this request: {exc}") from None
    except ProtocolError as exc:
        raise CheckFailed(f"the sealed answer holds no message: {exc}") from None
    return inner, True


def expect_error(
    target: Target, answer: Answer, req: GetMetadata | ReportFailed | None, code: ErrorCode
) -> str:
    """``answer`` is an ``error`` with ``code``, sealed exactly when §4 says: with a secret, a refusal of a
    request (``req``) goes plain only as ``unauthorized``; of a frame the server could not take as a
    request (``req`` None), as ``bad_request`` or ``incompatible`` too."""
    if req is None:  # the frame was not a request: no nonce to seal for
        msg, was_sealed = answer, False
        if isinstance(answer, Silence | Sealed):
            raise CheckFailed(f"want error {code.value}, got {describe(answer)}")
    else:
        msg, was_sealed = opened(target, answer, req)
    if not isinstance(msg, ErrorReply) or msg.code is not code:
        raise CheckFailed(f"want error {code.value}, got {describe(msg)}")
    if (
        target.secret is not None
        and req is not None
        and not was_sealed
        and code is not ErrorCode.UNAUTHORIZED
    ):
        raise CheckFailed(f"a plain {code.value} refusal under a secret: §4 says it must come sealed")
    if code is ErrorCode.UNAUTHORIZED and was_sealed:
        raise CheckFailed("a sealed unauthorized refusal: §4 says it goes plain")
    return f"error {code.value}" + (" (sealed)" if was_sealed else "")


async def fetch_metadata(target: Target, *, notif_only: bool) -> Metadata:
    req = metadata_request(target, notif_only=notif_only)
    msg, was_sealed = opened(target, await ask(target, req), req)
    if not isinstance(msg, Metadata):
        raise CheckFailed(f"get_metadata answered {describe(msg)}")
    if target.secret is not None and not was_sealed:
        raise CheckFailed("metadata came plain under a secret: §4 says it must come sealed")
    return msg


def new_nonce() -> bytes:
    return os.urandom(16)


def now_ms() -> int:
    return int(time.time() * 1000)


def report(target: Target, md: Metadata, **fields: object) -> ReportFailed:
    """A ``report_failed`` for ``target``'s rank, as a foreign P would send it, signed if need be."""
    base: dict[str, object] = {
        "pp_rank": target.pp_rank,
        "tp_rank": target.tp_rank,
        "to_incarnation": md.incarnation,
        "transfer_id": f"kvwire-conformance-{new_nonce().hex()}",
        "engine_id": "kvwire-conformance",
        "incarnation": new_nonce().hex(),
        "from_pp_rank": 0,
        "from_tp_rank": 0,
        "reason": FailReason.HANDSHAKE_FAILED.value,
    }
    base.update(fields)
    return signed(target, ReportFailed(**base))  # type: ignore[arg-type]
