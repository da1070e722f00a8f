"""Bytes <-> messages for both channels of wire contract v1.

This is the boundary where msgspec's exceptions are translated: every decoding function here raises only
``kvwire.errors`` types (``MalformedMessage``, ``UnknownMessageType``, ``VersionMismatch``,
``FrameTooLarge``), whatever bytes it is given.

* Notifications: ``b"KVW1"`` followed by one msgpack map (``encode_notif`` / ``decode_notif``).
* Side channel: frames of a 4-byte big-endian length and one msgpack map (``encode_frame``, and
  ``FrameDecoder`` to cut a byte stream into messages; ``parse_frame_header`` + ``decode_side`` for readers
  that read the header and the body separately, such as ``asyncio.StreamReader.readexactly``).
"""

from __future__ import annotations

import msgspec

from kvwire.errors import (
    FrameTooLarge,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    VersionMismatch,
)
from kvwire.protocol.limits import MAX_DEPTH, MAX_NOTIF_BYTES, MAX_WALK_ITEMS, nesting_depth
from kvwire.protocol.messages import (
    MAX_FRAME_BYTES,
    NOTIF_MAGIC,
    VERSION,
    Ack,
    Cancel,
    CancelAck,
    Claim,
    Done,
    ErrorReply,
    Failed,
    FailReason,
    GetMetadata,
    Granted,
    Heartbeat,
    Metadata,
    Notification,
    PushReg,
    ReportFailed,
    Sealed,
    SideMessage,
)

FRAME_HEADER_BYTES = 4

NOTIF_TYPES: frozenset[str] = frozenset(
    str(cls.__struct_config__.tag) for cls in (PushReg, Done, Failed, Cancel, CancelAck, Heartbeat)
)
SIDE_TYPES: frozenset[str] = frozenset(
    str(cls.__struct_config__.tag)
    for cls in (GetMetadata, Metadata, ErrorReply, Sealed, ReportFailed, Ack, Claim, Granted)
)


class _Envelope(msgspec.Struct):
    """The two fields every message has; decoded only to explain why a full decode failed."""

    type: object = None
    version: object = None


# Built once: a msgspec decoder compiles its type's schema at construction.
_ENCODER = msgspec.msgpack.Encoder()
_NOTIF_DECODER = msgspec.msgpack.Decoder(Notification)
_SIDE_DECODER = msgspec.msgpack.Decoder(SideMessage)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)

# What msgspec (or the C runtime under it) may raise on hostile input. Anything in this tuple means
# "these bytes are not a valid message"; it never escapes this module.
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError, MemoryError)


def _unwalkable(body: bytes, channel: str) -> MalformedMessage | None:
    """Refuses a body nested deeper than any message, before an untyped decode walks it (the typed
    decoders fail early on a wrong shape; the fallbacks that explain a failure would not). A body with
    too many items to walk cheaply is refused unexplained: the walk runs on the loop, unauthenticated."""
    depth = nesting_depth(body)
    if depth is None:
        return MalformedMessage(
            f"{channel}: not a valid message, and over {MAX_WALK_ITEMS} items "
            f"({len(body)} bytes): not explained"
        )
    if depth > MAX_DEPTH:
        return MalformedMessage(f"{channel}: nested deeper than {MAX_DEPTH} levels")
    return None


def _explain(body: bytes, known: frozenset[str], channel: str, err: Exception) -> ProtocolError:
    """Pick the most specific error for a body that did not decode as a message (and that
    ``_unwalkable`` accepted: the untyped decodes below rely on its bounds)."""
    try:
        env = _ENVELOPE_DECODER.decode(body)
    except _DECODE_ERRORS:
        return MalformedMessage(f"{channel}: not a msgpack map: {err}")
    # A newer peer may have retyped fields, so check its version before blaming the fields.
    if isinstance(env.version, int) and not isinstance(env.version, bool) and env.version > VERSION:
        return VersionMismatch(
            f"{channel}: version {env.version} is not supported (this side speaks {VERSION})"
        )
    if isinstance(env.type, str) and env.type not in known:
        return UnknownMessageType(f"{channel}: unknown message type {env.type[:64]!r}")
    return MalformedMessage(f"{channel}: {err}")


def _check_version(msg: Notification | SideMessage, channel: str) -> None:
    if msg.version > VERSION:
        raise VersionMismatch(
            f"{channel}: version {msg.version} is not supported (this side speaks {VERSION})"
        )


# --- notifications ---------------------------------------------------------------------------------


def encode_notif(msg: Notification) -> bytes:
    return NOTIF_MAGIC + _ENCODER.encode(msg)


# The last notification decoded from a ``bytes`` object, and that object: the driver decodes each one twice
# (its timeline marks, then the core that judges it), the second time from the same object. ``bytes`` are
# immutable, so the same object means the same message; decoded messages are never changed in place.
_last: list[tuple[bytes, Notification]] = []


def decode_notif(data: bytes | bytearray | memoryview) -> Notification:
    """Decode one notification; raises only ``kvwire.errors.ProtocolError`` subclasses."""
    last = _last
    if last and last[0][0] is data:
        return last[0][1]
    msg = _decode_notif(data)
    if type(data) is bytes:
        last[:] = [(data, msg)]
    return msg


def _decode_notif(data: bytes | bytearray | memoryview) -> Notification:
    # Slices copy (notifications are small): a memoryview kept alive by a traceback would pin the caller's
    # buffer.
    if len(data) > MAX_NOTIF_BYTES + len(NOTIF_MAGIC):
        raise MalformedMessage(f"notification of {len(data)} bytes is over the {MAX_NOTIF_BYTES}-byte limit")
    magic = bytes(data[: len(NOTIF_MAGIC)])
    if magic != NOTIF_MAGIC:
        raise MalformedMessage(f"notification: bad magic {magic!r}")
    body = bytes(data[len(NOTIF_MAGIC) :])
    try:
        msg = _NOTIF_DECODER.decode(body)
    except _DECODE_ERRORS as err:
        refused = _unwalkable(body, "notification")  # once, before either untyped decode below
        if refused is not None:
            raise refused from None
        failed = _failed_with_unknown_reason(body)
        if failed is None:
            raise _explain(body, NOTIF_TYPES, "notification", err) from None
        msg = failed
    _check_version(msg, "notification")
    return msg


def _failed_with_unknown_reason(body: bytes) -> Failed | None:
    """A ``failed`` whose reason this version does not know, as ``FailReason.UNKNOWN``: the peer still
    ended its registration, and dropping the message would leave D waiting for liveness. ``body`` has
    passed ``_unwalkable``."""
    try:
        raw = msgspec.msgpack.decode(body)
    except _DECODE_ERRORS:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "failed" or not isinstance(raw.get("reason"), str):
        return None
    if raw["reason"] in _FAIL_REASONS:
        return None  # something else is wrong with it
    raw["reason"] = FailReason.UNKNOWN.value
    try:
        return msgspec.convert(raw, Failed)
    except _DECODE_ERRORS:
        return None


_FAIL_REASONS = frozenset(r.value for r in FailReason)


# --- side channel ----------------------------------------------------------------------------------


def encode_body(msg: SideMessage) -> bytes:
    """A side-channel message without its frame header (what a ``Sealed`` reply encrypts)."""
    return _ENCODER.encode(msg)


def encode_frame(msg: SideMessage) -> bytes:
    """One side-channel frame; refuses (``FrameTooLarge``) what the receiver would refuse."""
    body = _ENCODER.encode(msg)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


def parse_frame_header(header: bytes | bytearray | memoryview) -> int:
    """The body length a 4-byte frame header announces, checked against the limit."""
    if len(header) != FRAME_HEADER_BYTES:
        raise MalformedMessage(f"frame header must be {FRAME_HEADER_BYTES} bytes, got {len(header)}")
    length = int.from_bytes(header, "big")
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame announces {length} bytes, over the {MAX_FRAME_BYTES}-byte limit")
    if length == 0:
        raise MalformedMessage("empty frame")
    return length


def decode_side(body: bytes | bytearray | memoryview) -> SideMessage:
    """Decode one side-channel frame body (without its header)."""
    try:
        msg = _SIDE_DECODER.decode(body)
    except _DECODE_ERRORS as err:
        raw = bytes(body)
        raise (_unwalkable(raw, "side channel") or _explain(raw, SIDE_TYPES, "side channel", err)) from None
    _check_version(msg, "side channel")
    return msg


class FrameDecoder:
    """Cuts a side-channel byte stream into messages, whatever the chunking.

    An oversized frame is refused as soon as its header is seen, before its body is buffered. After any
    error the stream is out of sync, so the decoder stays broken: every later ``feed`` raises again and the
    caller must drop the connection.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once its header is in
        self._broken: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[SideMessage]:
        if self._broken is not None:
            raise type(self._broken)(f"stream already failed: {self._broken}")
        self._buf += data
        try:
            return self._drain()
        except ProtocolError as err:
            self._broken = err
            self._buf.clear()
            raise

    def _drain(self) -> list[SideMessage]:
        out: list[SideMessage] = []
        pos = 0
        buf = self._buf
        while True:
            if self._need is None:
                if len(buf) - pos < FRAME_HEADER_BYTES:
                    break
                self._need = parse_frame_header(buf[pos : pos + FRAME_HEADER_BYTES])
                pos += FRAME_HEADER_BYTES
            if len(buf) - pos < self._need:
                break
            # A copy, not a memoryview: an export of ``buf`` alive in a traceback would forbid resizing it.
            out.append(decode_side(bytes(buf[pos : pos + self._need])))
            pos += self._need
            self._need = None
        if pos:
            del buf[:pos]
        return out
