"""Sealed replies and notifications (protocol/seal.py): what opens, and everything that must not."""

from __future__ import annotations

import pytest

from kvwire.errors import AuthError
from kvwire.protocol.auth import sign
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import Cancel, GetMetadata
from kvwire.protocol.seal import (
    NOTIF_TAG_BYTES,
    SEALED_NOTIF_MAGIC,
    NotifSeal,
    ReplySeal,
    derive_key,
    open_unsealed,
)

SECRET = b"s" * 32
TARGET = "10.0.0.2:5600"


def _req(target: str = TARGET) -> GetMetadata:
    return sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=target)


def test_keys_differ_by_purpose_and_secret() -> None:
    keys = {derive_key(SECRET, b"a"), derive_key(SECRET, b"b"), derive_key(b"t" * 32, b"a")}
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    with pytest.raises(AuthError):
        derive_key(b"", b"a")


def test_a_sealed_reply_opens_only_for_its_request_and_secret() -> None:
    req = _req()
    sealed = ReplySeal(SECRET).seal(b"metadata bytes", req)
    assert b"metadata bytes" not in sealed.box  # encrypted, not only authenticated
    assert ReplySeal(SECRET).open(sealed, req) == b"metadata bytes"
    for other_req, secret in (
        (_req(), SECRET),  # another request (another nonce): a captured reply replayed
        (_req("10.0.0.3:5600"), SECRET),  # made for another side channel
        (req, b"x" * 32),  # another secret
    ):
        with pytest.raises(AuthError):
            ReplySeal(secret).open(sealed, other_req)
    flipped = bytearray(sealed.box)
    flipped[0] ^= 1
    with pytest.raises(AuthError):
        ReplySeal(SECRET).open(type(sealed)(nonce=sealed.nonce, box=bytes(flipped)), req)
    with pytest.raises(AuthError):
        ReplySeal(SECRET).open(type(sealed)(nonce=b"short", box=sealed.box), req)
    with pytest.raises(AuthError):  # an unsigned request cannot be answered sealed
        ReplySeal(SECRET).seal(b"x", GetMetadata(pp_rank=0, tp_rank=0))


def test_a_sealed_notification_opens_only_for_its_sender_and_receiver() -> None:
    raw = encode_notif(Cancel(transfer_id="t", engine_id="d", incarnation="i"))
    seal = NotifSeal(SECRET)
    sealed = seal.seal("d/i/pp0/tp0", "p/j/pp0/tp0", raw)
    assert sealed.startswith(SEALED_NOTIF_MAGIC) and len(sealed) == len(raw) + 4 + NOTIF_TAG_BYTES
    assert decode_notif(seal.open("d/i/pp0/tp0", "p/j/pp0/tp0", sealed)) == decode_notif(raw)
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for sender, receiver, data in (
        ("x/i/pp0/tp0", "p/j/pp0/tp0", sealed),  # another sender name: a peer posing as another
        ("d/i/pp0/tp0", "q/j/pp0/tp0", sealed),  # delivered to another receiver
        ("d/i/pp0/tp0", "p/j/pp0/tp0", tampered),
        ("d/i/pp0/tp0", "p/j/pp0/tp0", raw),  # unsealed
        ("d/i/pp0/tp0", "p/j/pp0/tp0", b"junk"),
    ):
        with pytest.raises(AuthError):
            seal.open(sender, receiver, data)
    with pytest.raises(AuthError):
        NotifSeal(b"y" * 32).open("d/i/pp0/tp0", "p/j/pp0/tp0", sealed)
    # Without a secret: plain notifications pass, sealed ones cannot be checked and are refused.
    assert open_unsealed("d/i/pp0/tp0", raw) == raw
    with pytest.raises(AuthError):
        open_unsealed("d/i/pp0/tp0", sealed)
