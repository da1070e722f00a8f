"""Shared-secret authentication of side-channel ``get_metadata`` requests (wire contract v1).

``auth`` is HMAC-SHA256, keyed with the cluster's shared secret, over a canonical encoding of the request's
other fields: the msgpack array ``[b"kvwire/get_metadata", version, pp_rank, tp_rank, notif_only, nonce]``.
An explicit array, not the encoded Struct, so that a field added later (with a default) does not change what
an older peer computes; such a field is authenticated only once it is appended here under a new version.

The nonce (16 random bytes) makes every signature distinct. It does not by itself stop a replay; a server
that cares keeps a ``ReplayGuard`` of the nonces it has accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict

import msgspec

from kvwire.errors import AuthError, ConfigError
from kvwire.protocol.messages import GetMetadata

NONCE_BYTES = 16
_DOMAIN = b"kvwire/get_metadata"
_ENCODER = msgspec.msgpack.Encoder()


def signed_bytes(req: GetMetadata) -> bytes:
    """The canonical bytes that ``auth`` covers."""
    return _ENCODER.encode([_DOMAIN, req.version, req.pp_rank, req.tp_rank, req.notif_only, req.nonce])


def _mac(req: GetMetadata, secret: bytes) -> bytes:
    return hmac.new(secret, signed_bytes(req), hashlib.sha256).digest()


def sign(req: GetMetadata, secret: bytes, *, nonce: bytes | None = None) -> GetMetadata:
    """A copy of ``req`` with a fresh nonce (or the given one, for tests) and its ``auth``."""
    if not secret:
        raise AuthError("an empty secret cannot sign")
    fresh = nonce if nonce is not None else os.urandom(NONCE_BYTES)
    if len(fresh) != NONCE_BYTES:
        raise AuthError(f"nonce must be {NONCE_BYTES} bytes, got {len(fresh)}")
    unsigned = msgspec.structs.replace(req, nonce=fresh, auth=None)
    return msgspec.structs.replace(unsigned, auth=_mac(unsigned, secret))


def verify(req: GetMetadata, secret: bytes | None) -> None:
    """Accept ``req`` or raise ``AuthError``. Without a secret (``None`` or empty) every request passes."""
    if not secret:
        return
    if req.auth is None or req.nonce is None:
        raise AuthError("request is not authenticated, but this side requires a shared secret")
    if len(req.nonce) != NONCE_BYTES:
        raise AuthError(f"nonce must be {NONCE_BYTES} bytes, got {len(req.nonce)}")
    if not hmac.compare_digest(req.auth, _mac(req, secret)):
        raise AuthError("bad request signature")


class ReplayGuard:
    """Remembers the last ``capacity`` accepted nonces and refuses a repeat (bounded memory)."""

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity <= 0:
            raise ConfigError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, req: GetMetadata) -> None:
        """Call after ``verify``: raise ``AuthError`` if this nonce was accepted before, else remember it."""
        if req.nonce is None:
            raise AuthError("request has no nonce")
        if req.nonce in self._seen:
            raise AuthError("replayed request (nonce already used)")
        self._seen[req.nonce] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
