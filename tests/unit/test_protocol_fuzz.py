"""Random bytes into both decoders: only kvwire errors may come out, and valid messages survive mutation."""

from __future__ import annotations

import contextlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.errors import ProtocolError
from kvwire.protocol.codec import FrameDecoder, decode_notif, decode_side, encode_frame, encode_notif
from kvwire.protocol.messages import GetMetadata, PushReg, SideMessage

_FAST = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_VALID_NOTIF = encode_notif(
    PushReg(
        transfer_id="t",
        engine_id="d",
        incarnation="i",
        tp_rank=0,
        tp_size=1,
        host="127.0.0.1",
        port=1,
        block_ids=[1, 2, 3],
        num_tokens=48,
    )
)
_VALID_FRAME = encode_frame(GetMetadata(pp_rank=0, tp_rank=0, nonce=b"n" * 16, auth=b"a" * 32))


@_FAST
@given(st.binary(max_size=256))
def test_decode_notif_random_bytes(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_notif(b"KVW1" + data)
    with contextlib.suppress(ProtocolError):
        decode_notif(data)


@_FAST
@given(st.integers(0, len(_VALID_NOTIF) - 1), st.integers(0, 255), st.integers(0, len(_VALID_NOTIF)))
def test_decode_notif_mutated_valid(pos: int, byte: int, cut: int) -> None:
    data = bytearray(_VALID_NOTIF)
    data[pos] = byte
    try:
        msg = decode_notif(bytes(data[:cut]) + bytes(data[cut:]))
    except ProtocolError:
        return
    # Whatever survives a mutation is a valid v1 message: it round-trips exactly.
    assert msg.version == 1
    assert decode_notif(encode_notif(msg)) == msg


@_FAST
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_frame_decoder_random_chunks(chunks: list[bytes]) -> None:
    dec = FrameDecoder()
    with contextlib.suppress(ProtocolError):
        for chunk in chunks:
            dec.feed(chunk)


@_FAST
@given(st.integers(0, len(_VALID_FRAME) - 1), st.integers(0, 255), st.integers(1, 16))
def test_frame_decoder_mutated_valid(pos: int, byte: int, chunk: int) -> None:
    data = bytearray(_VALID_FRAME * 2)
    data[pos] = byte
    dec = FrameDecoder()
    got: list[SideMessage] = []
    with contextlib.suppress(ProtocolError):
        for i in range(0, len(data), chunk):
            got += dec.feed(data[i : i + chunk])
    for msg in got:
        assert decode_side(encode_frame(msg)[4:]) == msg
