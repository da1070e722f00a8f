"""Authenticated replies and notifications under the cluster's shared secret (wire contract v1, secure mode).

A signed request (``protocol/auth.py``) proves the requester holds the secret; this module makes the other
two things an outsider must not forge or read hold too:

* **Replies.** A server answers a verified request with a ``Sealed`` frame: the reply (``Metadata`` or
  ``ErrorReply``) encrypted with AES-256-GCM (``cryptography``, no home-made crypto) under a key derived
  from the secret, with the request's nonce and target as associated data. Only a holder of the secret can
  read it (the full metadata is what lets a peer write into this engine's memory), and it opens only for
  the request it answers: a reply captured earlier, or one made for another request, fails to open.
* **Notifications.** ``seal_notif`` prefixes a notification with ``KVS1`` and a 16-byte HMAC-SHA256 tag
  over (sender agent name, receiver agent name, the notification's bytes) under another derived key. NIXL
  lets a sender choose its own name; the tag is what binds the name: a notification claiming to come from
  an engine life verifies only if it was made by a holder of the secret for exactly this receiver.

Keys: HKDF-SHA256 of the secret, one per purpose (``info``), so the MAC key of requests (the secret itself,
kept for v1 compatibility), of notifications and the encryption key of replies never coincide.
Everyone holding the secret is trusted alike: the secret authenticates the cluster, not one engine.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvwire.errors import AuthError
from kvwire.protocol.auth import SignedRequest
from kvwire.protocol.messages import NOTIF_MAGIC, Sealed

SEALED_NOTIF_MAGIC = b"KVS1"
NOTIF_TAG_BYTES = 16  # 128-bit tags: forging one is as hard as guessing it
GCM_NONCE_BYTES = 12
_REPLY_INFO = b"kvwire/reply-key/1"
_NOTIF_INFO = b"kvwire/notif-key/1"
_REPLY_AAD = b"kvwire/reply/1"
_NOTIF_DOMAIN = b"kvwire/notif/1"
_ENCODER = msgspec.msgpack.Encoder()


def derive_key(secret: bytes, info: bytes) -> bytes:
    """A 32-byte key for one purpose (HKDF-SHA256, no salt: the secret is already a random key)."""
    if not secret:
        raise AuthError("an empty secret derives no key")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _reply_aad(req: SignedRequest) -> bytes:
    if req.nonce is None or req.target is None:
        raise AuthError("only a signed request (nonce and target) can be answered sealed")
    return _ENCODER.encode([_REPLY_AAD, req.nonce, req.target])


class ReplySeal:
    """Seals a server's reply to one verified request; opens the reply to a request this side made."""

    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(derive_key(secret, _REPLY_INFO))

    def seal(self, body: bytes, req: SignedRequest) -> Sealed:
        """``body``: the encoded reply message (msgpack, no frame header)."""
        nonce = os.urandom(GCM_NONCE_BYTES)
        return Sealed(nonce=nonce, box=self._aead.encrypt(nonce, body, _reply_aad(req)))

    def open(self, sealed: Sealed, req: SignedRequest) -> bytes:
        """The reply's encoded message, or ``AuthError`` if it was not made for ``req`` with this secret."""
        if len(sealed.nonce) != GCM_NONCE_BYTES:
            raise AuthError(f"sealed reply: nonce must be {GCM_NONCE_BYTES} bytes, got {len(sealed.nonce)}")
        try:
            return self._aead.decrypt(sealed.nonce, sealed.box, _reply_aad(req))
        except InvalidTag:
            raise AuthError(
                "sealed reply does not open: not made for this request, or sealed with another secret"
            ) from None


class NotifSeal:
    """Tags the notifications one agent sends and checks the ones it receives."""

    def __init__(self, secret: bytes) -> None:
        self._key = derive_key(secret, _NOTIF_INFO)

    def _tag(self, sender: str, receiver: str, data: bytes) -> bytes:
        signed = _ENCODER.encode([_NOTIF_DOMAIN, sender, receiver, data])
        return hmac.new(self._key, signed, hashlib.sha256).digest()[:NOTIF_TAG_BYTES]

    def seal(self, sender: str, receiver: str, data: bytes) -> bytes:
        """``data`` (an encoded notification) as ``KVS1`` + tag + ``data``."""
        return SEALED_NOTIF_MAGIC + self._tag(sender, receiver, data) + data

    def open(self, sender: str, receiver: str, sealed: bytes) -> bytes:
        """The notification inside ``sealed`` if ``sender`` made it for ``receiver``; else ``AuthError``."""
        head = len(SEALED_NOTIF_MAGIC)
        if bytes(sealed[:head]) != SEALED_NOTIF_MAGIC:
            if bytes(sealed[:head]) == NOTIF_MAGIC:
                raise AuthError(f"unauthenticated notification from {sender} (no KVWIRE_SECRET there?)")
            raise AuthError(f"notification from {sender} is not sealed")
        tag, data = bytes(sealed[head : head + NOTIF_TAG_BYTES]), bytes(sealed[head + NOTIF_TAG_BYTES :])
        if not hmac.compare_digest(tag, self._tag(sender, receiver, data)):
            raise AuthError(f"notification claiming to be from {sender}: bad tag (forged, or another secret)")
        return data


def open_unsealed(sender: str, data: bytes) -> bytes:
    """A receiver without a secret: a sealed notification means the sender has one (a secret on one side
    only), which this side cannot check; refuse it rather than act on what it cannot authenticate."""
    if bytes(data[: len(SEALED_NOTIF_MAGIC)]) == SEALED_NOTIF_MAGIC:
        raise AuthError(f"sealed notification from {sender}, but this side has no KVWIRE_SECRET")
    return data


class NotifGate:
    """What a connector applies to every notification, with or without a secret."""

    def __init__(self, secret: bytes | None, accept_secret: bytes | None = None) -> None:
        self._seal = NotifSeal(secret) if secret else None
        # KVWIRE_SECRET_ACCEPT (the cluster's secret being rotated): its tags are taken too, never made.
        self._also = NotifSeal(accept_secret) if secret and accept_secret else None

    def outgoing(self, sender: str, receiver: str, data: bytes) -> bytes:
        return data if self._seal is None else self._seal.seal(sender, receiver, data)

    def incoming(self, sender: str, receiver: str, data: bytes) -> bytes:
        """The notification ``sender`` sent, or ``AuthError`` when this side cannot authenticate it."""
        if self._seal is None:
            return open_unsealed(sender, data)
        try:
            return self._seal.open(sender, receiver, data)
        except AuthError:
            if self._also is None:
                raise
            return self._also.open(sender, receiver, data)
