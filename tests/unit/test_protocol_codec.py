"""Both channels' codecs: round trips, exact bytes, and every kind of bad input mapped to a kvwire error."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvwire.errors import FrameTooLarge, MalformedMessage, ProtocolError, UnknownMessageType, VersionMismatch
from kvwire.protocol.codec import (
    FrameDecoder,
    decode_notif,
    decode_side,
    encode_frame,
    encode_notif,
    parse_frame_header,
)
from kvwire.protocol.limits import MAX_DEPTH, MAX_NOTIF_BYTES, MAX_WALK_ITEMS, nesting_depth
from kvwire.protocol.messages import (
    MAX_FRAME_BYTES,
    NOTIF_MAGIC,
    Cancel,
    CancelAck,
    Done,
    ErrorCode,
    ErrorReply,
    Failed,
    FailReason,
    GetMetadata,
    Heartbeat,
    KVInfo,
    Metadata,
    Notification,
    PushReg,
    RegionMsg,
    SideMessage,
)

_IDS = {"transfer_id": "t-1", "engine_id": "p0", "incarnation": "inc-a"}

NOTIFS: list[Notification] = [
    PushReg(**_IDS, tp_rank=1, tp_size=2, host="127.0.0.1", port=5555, block_ids=[3, 1, 2], num_tokens=40),
    Done(**_IDS, tp_rank=0, pp_rank=1, num_blocks=3),
    Failed(**_IDS, tp_rank=0, pp_rank=0, reason=FailReason.FENCE_EXPIRED),
    Cancel(**_IDS),
    CancelAck(**_IDS, tp_rank=1, pp_rank=0, wrote=True),
    Heartbeat(transfer_id="", engine_id="d0", incarnation="inc-b", transfer_ids=["a", "b"]),
]

KV = KVInfo(
    num_layers=32,
    first_layer=0,
    kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    block_size=16,
    layout="HND",
    mla=False,
)
SIDE: list[SideMessage] = [
    GetMetadata(pp_rank=0, tp_rank=3, notif_only=True),
    Metadata(
        engine_id="d0",
        incarnation="inc",
        compat_hash="ab" * 32,
        tp_size=4,
        tp_rank=3,
        pp_size=1,
        pp_rank=0,
        agent_name="d0-3",
        agent_metadata=b"\x00\x01\xff" * 100,
        kv=KV,
        num_blocks=1000,
        regions=[RegionMsg(layer=0, kind="k", base_addr=2**40, block_len=65536, num_blocks=1000)],
        server_time=1.5,
    ),
    ErrorReply(code=ErrorCode.NO_SUCH_RANK, message="rank 9"),
]

_ENC = msgspec.msgpack.Encoder()


def _notif_dict(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "type": "done",
        "version": 1,
        **_IDS,
        "tp_rank": 0,
        "pp_rank": 0,
        "num_blocks": 2,
    }
    base.update(over)
    return base


def _raw_notif(obj: object) -> bytes:
    return b"KVW1" + _ENC.encode(obj)


def _raw_frame(obj: object) -> bytes:
    body = _ENC.encode(obj)
    return len(body).to_bytes(4, "big") + body


# --- notifications ---------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", NOTIFS, ids=lambda m: type(m).__name__)
def test_notif_round_trip(msg: Notification) -> None:
    data = encode_notif(msg)
    assert data.startswith(b"KVW1")
    assert decode_notif(data) == msg
    assert decode_notif(bytearray(data)) == msg
    assert decode_notif(memoryview(data)) == msg


def test_notif_bytes_are_magic_then_tagged_msgpack_map() -> None:
    data = encode_notif(NOTIFS[1])
    # The fields added with defaults travel too (an older peer ignores them).
    added = {"reg_nonce": 0, "nbytes": None, "digest": None}
    assert msgspec.msgpack.decode(data[4:]) == _notif_dict(pp_rank=1, num_blocks=3, **added)


def test_notif_unknown_fields_are_ignored() -> None:
    msg = decode_notif(_raw_notif(_notif_dict(future_field=[1, 2])))
    assert msg == Done(**_IDS, tp_rank=0, pp_rank=0, num_blocks=2)


@pytest.mark.parametrize(
    "data",
    [b"", b"KVW", b"KVW2" + _ENC.encode(_notif_dict()), b"XXXX", _ENC.encode(_notif_dict())],
    ids=["empty", "short-magic", "wrong-magic-version", "garbage", "no-magic"],
)
def test_notif_bad_magic(data: bytes) -> None:
    with pytest.raises(MalformedMessage, match="magic"):
        decode_notif(data)


def test_notif_truncated_at_every_length() -> None:
    data = encode_notif(NOTIFS[0])
    for cut in range(4, len(data)):
        with pytest.raises(MalformedMessage):
            decode_notif(data[:cut])


@pytest.mark.parametrize(
    "obj",
    [
        _notif_dict(tp_rank="0"),
        _notif_dict(num_blocks=-1),
        _notif_dict(version="1"),
        _notif_dict(version=0),
        _notif_dict(transfer_id=7),
        {k: v for k, v in _notif_dict().items() if k != "num_blocks"},
        {k: v for k, v in _notif_dict().items() if k != "type"},
        _notif_dict(type=5),
        [1, 2, 3],
        "done",
        None,
        {"type": "failed", "version": 1, **_IDS, "tp_rank": "0", "pp_rank": 0, "reason": "bored"},
        {"type": "push_reg", "version": 1, **_IDS, "tp_rank": 0, "tp_size": 1, "host": "h", "port": 1,
         "block_ids": [1, -2], "num_tokens": 3},
        {"type": "push_reg", "version": 1, **_IDS, "tp_rank": 0, "tp_size": 0, "host": "h", "port": 1,
         "block_ids": [1], "num_tokens": 3},
    ],
)  # fmt: skip
def test_notif_wrong_types_are_malformed(obj: object) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode_notif(_raw_notif(obj))
    assert type(info.value) is MalformedMessage


@pytest.mark.parametrize("kind", ["get_metadata", "metadata", "hello", ""])
def test_notif_unknown_type(kind: str) -> None:
    with pytest.raises(UnknownMessageType, match="unknown message type"):
        decode_notif(_raw_notif(_notif_dict(type=kind)))


def test_notif_version_2_refused_even_if_otherwise_valid() -> None:
    with pytest.raises(VersionMismatch, match="version 2"):
        decode_notif(_raw_notif(_notif_dict(version=2)))


def test_notif_version_2_refused_even_if_retyped_or_unknown_type() -> None:
    with pytest.raises(VersionMismatch):
        decode_notif(_raw_notif(_notif_dict(version=2, num_blocks="many")))
    with pytest.raises(VersionMismatch):
        decode_notif(_raw_notif({"type": "push_reg_v2", "version": 2}))


def test_notif_trailing_bytes_are_malformed() -> None:
    with pytest.raises(MalformedMessage):
        decode_notif(encode_notif(NOTIFS[1]) + b"\x00")


# --- side channel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SIDE, ids=lambda m: type(m).__name__)
def test_frame_round_trip(msg: SideMessage) -> None:
    frame = encode_frame(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decode_side(frame[4:]) == msg
    dec = FrameDecoder()
    assert dec.feed(frame) == [msg]
    assert dec.buffered == 0


def test_frame_decoder_any_chunking() -> None:
    stream = b"".join(encode_frame(m) for m in SIDE * 3)
    for size in (1, 2, 3, 5, 7, 64, len(stream)):
        dec = FrameDecoder()
        got: list[SideMessage] = []
        for i in range(0, len(stream), size):
            got += dec.feed(stream[i : i + size])
        assert got == SIDE * 3
        assert dec.buffered == 0


def test_frame_decoder_keeps_partial_frame() -> None:
    a, b = encode_frame(SIDE[0]), encode_frame(SIDE[2])
    dec = FrameDecoder()
    assert dec.feed(a + b[:6]) == [SIDE[0]]
    assert dec.buffered == 2  # header consumed, 2 body bytes waiting
    assert dec.feed(b[6:]) == [SIDE[2]]


def test_oversized_frame_refused_at_header() -> None:
    dec = FrameDecoder()
    header = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(FrameTooLarge):
        dec.feed(header[:3])  # not yet: header incomplete
        dec.feed(header[3:])
    assert dec.buffered == 0
    with pytest.raises(FrameTooLarge):
        dec.feed(encode_frame(SIDE[0]))  # broken stream stays broken


def test_frame_at_limit_is_accepted_by_header_check() -> None:
    assert parse_frame_header(MAX_FRAME_BYTES.to_bytes(4, "big")) == MAX_FRAME_BYTES
    with pytest.raises(FrameTooLarge):
        parse_frame_header(b"\xff\xff\xff\xff")
    with pytest.raises(MalformedMessage):
        parse_frame_header(b"\x00\x00\x00\x00")
    with pytest.raises(MalformedMessage):
        parse_frame_header(b"\x00\x01")


def test_encode_frame_refuses_oversized_message() -> None:
    msg = ErrorReply(code=ErrorCode.BAD_REQUEST, message="x" * MAX_FRAME_BYTES)
    with pytest.raises(FrameTooLarge):
        encode_frame(msg)


def test_truncated_frame_body_is_malformed() -> None:
    frame = encode_frame(SIDE[1])
    body = frame[4:]
    for cut in range(0, len(body), 37):
        with pytest.raises(MalformedMessage):
            decode_side(body[:cut])
    # A header that lies about the length: the body ends where the next frame starts.
    lying = (len(body) - 3).to_bytes(4, "big") + body
    with pytest.raises(MalformedMessage):
        FrameDecoder().feed(lying)


@pytest.mark.parametrize(
    ("obj", "err"),
    [
        ({"type": "get_metadata", "version": 1, "pp_rank": "0", "tp_rank": 0}, MalformedMessage),
        ({"type": "get_metadata", "version": 1, "pp_rank": -1, "tp_rank": 0}, MalformedMessage),
        ({"type": "get_metadata", "version": 1, "tp_rank": 0}, MalformedMessage),
        ({"type": "error", "version": 1, "code": "teapot", "message": ""}, MalformedMessage),
        ([0, 1], MalformedMessage),
        ({"type": "done", "version": 1}, UnknownMessageType),  # a notification is not a side message
        ({"type": "nope"}, UnknownMessageType),
        ({"type": "get_metadata", "version": 2, "pp_rank": 0, "tp_rank": 0}, VersionMismatch),
        ({"type": "get_metadata_v2", "version": 2}, VersionMismatch),
    ],
)
def test_side_bad_messages(obj: object, err: type[ProtocolError]) -> None:
    with pytest.raises(err) as info:
        FrameDecoder().feed(_raw_frame(obj))
    assert type(info.value) is err


def test_frame_decoder_error_after_good_frames_breaks_stream() -> None:
    dec = FrameDecoder()
    with pytest.raises(UnknownMessageType):
        dec.feed(encode_frame(SIDE[0]) + _raw_frame({"type": "nope"}))
    with pytest.raises(UnknownMessageType, match="already failed"):
        dec.feed(encode_frame(SIDE[0]))


def test_a_failed_with_an_unknown_reason_decodes_as_unknown() -> None:
    """A newer peer's reason is still a failure (dropping it would leave D waiting for liveness)."""
    body = {"type": "failed", "version": 1, **_IDS, "tp_rank": 0, "pp_rank": 0, "reason": "bored"}
    msg = decode_notif(NOTIF_MAGIC + msgspec.msgpack.encode(body))
    assert isinstance(msg, Failed) and msg.reason is FailReason.UNKNOWN


# --- nesting limits -----------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
def test_deep_nesting_is_malformed_on_both_channels(depth: int) -> None:
    failed = b"\x83\xa4type\xa6failed\xa6reason\xa3new\xa1x" + _nested(depth)
    for body in (_nested(depth), b"\x81\xa1a" * depth + b"\xc0", failed):
        with pytest.raises(MalformedMessage, match="nested deeper"):
            decode_notif(NOTIF_MAGIC + body)
        with pytest.raises(MalformedMessage, match="nested deeper"):
            decode_side(body)


def test_nesting_depth_matches_the_structure() -> None:
    cases: list[tuple[object, int]] = [
        (1, 0),
        ([], 1),
        ({}, 1),
        ([[], {"a": [1, b"x" * 300, "y" * 70_000]}], 3),
        ({"k": msgspec.msgpack.Ext(1, b"\x91" * 40)}, 1),  # an ext's payload is opaque
        ([1.5, None, True, -(2**40), 2**63], 1),
    ]
    for obj, want in cases:
        assert nesting_depth(msgspec.msgpack.encode(obj)) == want
    # The walk stops just past the limit, whatever the real depth.
    assert nesting_depth(_nested(10**6)) == MAX_DEPTH + 1


def test_an_oversized_notification_is_refused_before_decoding() -> None:
    with pytest.raises(MalformedMessage, match="over the"):
        decode_notif(NOTIF_MAGIC + b"\xc4" + bytes(MAX_NOTIF_BYTES))


def _flat_array_body(size: int) -> bytes:
    """``{"type": [nil, nil, ...]}`` of exactly ``size`` bytes: a valid msgpack map that fails the typed
    decode and holds about one item per byte."""
    head = b"\x81\xa4type\xdd"
    count = size - len(head) - 4
    return head + count.to_bytes(4, "big") + b"\xc0" * count


def test_the_shape_walk_stops_after_its_item_budget() -> None:
    flat = msgspec.msgpack.encode([None] * (MAX_WALK_ITEMS + 1))
    assert nesting_depth(flat) is None
    assert nesting_depth(msgspec.msgpack.encode([None] * (MAX_WALK_ITEMS - 2))) == 1
    # The depth limit still wins when it is met first.
    assert nesting_depth(_nested(10**6)) == MAX_DEPTH + 1


def test_huge_flat_bodies_are_refused_without_walking_them() -> None:
    """Both decoders run on the event loop before authentication: a 16 MiB frame of 16 million nils took
    about 4 s of pure-Python walking (a 4 MiB notification about 2 s); now about 15 ms each here. The
    bound leaves a 30x margin on a slow, shared machine."""
    frame = _flat_array_body(MAX_FRAME_BYTES)
    start = time.perf_counter()
    with pytest.raises(MalformedMessage, match="not explained"):
        FrameDecoder().feed(len(frame).to_bytes(4, "big") + frame)
    assert time.perf_counter() - start < 0.5
    notif = NOTIF_MAGIC + _flat_array_body(MAX_NOTIF_BYTES)
    start = time.perf_counter()
    with pytest.raises(MalformedMessage, match="not explained"):
        decode_notif(notif)
    assert time.perf_counter() - start < 0.5


def test_ids_and_heartbeat_lists_past_their_bounds_are_malformed() -> None:
    # Ids key bounded tables (the connector's timeline, P's tombstones) and a heartbeat's every id is
    # looked up: a peer's 4 MiB id, or a million ids in one heartbeat, is refused at the decode.
    from kvwire.protocol.limits import MAX_HEARTBEAT_IDS, MAX_ID_CHARS
    from kvwire.protocol.messages import Heartbeat, id_batches

    def hb(ids: list[str], tid: str = "") -> Heartbeat:
        return Heartbeat(transfer_id=tid, engine_id="e", incarnation="i", transfer_ids=ids)

    assert decode_notif(encode_notif(hb(["t"] * MAX_HEARTBEAT_IDS))) == hb(["t"] * MAX_HEARTBEAT_IDS)
    with pytest.raises(MalformedMessage, match="length"):
        decode_notif(encode_notif(hb(["t"] * (MAX_HEARTBEAT_IDS + 1))))
    with pytest.raises(MalformedMessage, match="length"):
        decode_notif(encode_notif(hb([], tid="x" * (MAX_ID_CHARS + 1))))
    with pytest.raises(MalformedMessage, match="length"):
        decode_notif(encode_notif(hb(["x" * (MAX_ID_CHARS + 1)])))
    # A sender splits a longer live set: every id once, each part within the bound.
    ids = [f"t{i}" for i in range(2 * MAX_HEARTBEAT_IDS + 5)]
    parts = id_batches(ids)
    assert [len(p) for p in parts] == [MAX_HEARTBEAT_IDS, MAX_HEARTBEAT_IDS, 5]
    assert [t for p in parts for t in p] == ids and id_batches([]) == [[]]
    # By bytes too: 16,384 ids of 1,024 characters would be a 16 MiB heartbeat its peer refuses.
    long_ids = [f"{i:08d}" + "x" * (MAX_ID_CHARS - 8) for i in range(5000)]
    parts = id_batches(long_ids)
    assert len(parts) > 1 and [t for p in parts for t in p] == long_ids
    for part in parts:
        assert decode_notif(encode_notif(hb(part))) == hb(part)


def test_a_push_regs_host_past_255_characters_is_malformed() -> None:
    """A push_reg's host had no bound: 150 push_regs with 1 MiB hosts held 150 MiB in P's handshake table
    and tombstones and wrote MiB-long log lines."""
    from kvwire.protocol.messages import PushReg

    def reg(host: str) -> PushReg:
        return PushReg(transfer_id="t", engine_id="D", incarnation="i", tp_rank=0, tp_size=1, host=host,
                       port=7000, block_ids=[0], num_tokens=1)  # fmt: skip

    assert decode_notif(encode_notif(reg("h" * 255))) == reg("h" * 255)
    for bad in ("h" * 256, ""):
        with pytest.raises(MalformedMessage, match="length"):
            decode_notif(encode_notif(reg(bad)))


def test_kv_transfer_params_remote_host_and_port_are_bounded() -> None:
    from kvwire.kv_params import KvTransferParams

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"remote_host": "h" * 256}, KvTransferParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"remote_port": 70000}, KvTransferParams)
    # P's block ids (pull): 2,000,000 were taken (16 MB kept per request) until P refused the claim.
    ids = list(range(1 << 20))
    assert msgspec.convert({"remote_block_ids": ids}, KvTransferParams).remote_block_ids == tuple(ids)
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.convert({"remote_block_ids": [*ids, 0]}, KvTransferParams)
