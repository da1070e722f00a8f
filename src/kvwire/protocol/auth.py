"""Shared-secret authentication of side-channel requests, ``get_metadata`` and ``report_failed`` (wire
contract v1).

``auth`` is HMAC-SHA256, keyed with the cluster's shared secret, over a canonical encoding of the request's
other fields: the msgpack array ``[b"kvwire/get_metadata/2", version, pp_rank, tp_rank, notif_only, nonce,
target, ts_ms]``. An explicit array, not the encoded Struct, so that a field added later (with a default)
does not change what an older peer computes.

Why ``target`` and ``ts_ms``: engines send signed requests to addresses taken from requests (a decode
leg's ``remote_host``, a ``push_reg``'s ``host``). Without them, an outsider who made an engine sign a
request to its own listener could relay it to any other engine and collect that engine's metadata (the
relay that let an outsider write into D's cache). A request now names the side channel it was meant for
(``host:port`` as dialled) and when it was made; a server refuses one meant for another address, older or
newer than ``MAX_SKEW_MS``, or whose nonce it accepted before (``ReplayGuard``, sized for that window).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import msgspec

from kvwire.errors import AuthError, ConfigError
from kvwire.protocol.messages import Claim, GetMetadata, ReportFailed

# The side-channel requests a shared secret authenticates.
SignedRequest = GetMetadata | ReportFailed | Claim
R = TypeVar("R", GetMetadata, ReportFailed, Claim)

NONCE_BYTES = 16
_DOMAIN = b"kvwire/get_metadata/2"
_REPORT_DOMAIN = b"kvwire/report_failed/1"
_CLAIM_DOMAIN = b"kvwire/claim/1"
MAX_SKEW_MS = 30_000  # clocks of a cluster agree far better (NTP); a longer window only helps a replay
_ENCODER = msgspec.msgpack.Encoder()


def signed_bytes(req: SignedRequest) -> bytes:
    """The canonical bytes that ``auth`` covers."""
    if isinstance(req, Claim):
        return _ENCODER.encode(
            [
                _CLAIM_DOMAIN,
                req.version,
                req.pp_rank,
                req.tp_rank,
                req.to_incarnation,
                req.transfer_id,
                req.block_ids,
                req.engine_id,
                req.incarnation,
                req.from_pp_rank,
                req.from_tp_rank,
                req.tp_size,
                req.nonce,
                req.target,
                req.ts_ms,
            ]
        )
    if isinstance(req, ReportFailed):
        return _ENCODER.encode(
            [
                _REPORT_DOMAIN,
                req.version,
                req.pp_rank,
                req.tp_rank,
                req.to_incarnation,
                req.transfer_id,
                req.engine_id,
                req.incarnation,
                req.from_pp_rank,
                req.from_tp_rank,
                req.reason,
                req.nonce,
                req.target,
                req.ts_ms,
            ]
        )
    return _ENCODER.encode(
        [_DOMAIN, req.version, req.pp_rank, req.tp_rank, req.notif_only, req.nonce, req.target, req.ts_ms]
    )


def _mac(req: SignedRequest, secret: bytes) -> bytes:
    return hmac.new(secret, signed_bytes(req), hashlib.sha256).digest()


def sign(req: R, secret: bytes, *, target: str, now_ms: int | None = None, nonce: bytes | None = None) -> R:
    """A copy of ``req`` bound to ``target`` (``host:port`` being dialled) and now, with a fresh nonce (or
    the given one, for tests) and its ``auth``."""
    if not secret:
        raise AuthError("an empty secret cannot sign")
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    fresh = nonce if nonce is not None else os.urandom(NONCE_BYTES)
    if len(fresh) != NONCE_BYTES:
        raise AuthError(f"nonce must be {NONCE_BYTES} bytes, got {len(fresh)}")
    unsigned = msgspec.structs.replace(req, nonce=fresh, auth=None, target=target, ts_ms=ts)
    return msgspec.structs.replace(unsigned, auth=_mac(unsigned, secret))


def verify(
    req: SignedRequest,
    secret: bytes | None,
    *,
    is_mine: Callable[[str], bool] | None = None,
    now_ms: int | None = None,
    also: bytes | None = None,
) -> None:
    """Accept ``req`` or raise ``AuthError``. Without a secret (``None`` or empty) every request passes.
    ``is_mine(target)``: whether the request was meant for this server (None: not checked). ``also``: a
    second secret accepted (``KVWIRE_SECRET_ACCEPT``, while the cluster's secret is rotated)."""
    if not secret:
        return
    if req.auth is None or req.nonce is None or req.target is None or req.ts_ms is None:
        raise AuthError(
            "request is not authenticated (or not bound to a target), but this side requires a shared secret"
        )
    if len(req.nonce) != NONCE_BYTES:
        raise AuthError(f"nonce must be {NONCE_BYTES} bytes, got {len(req.nonce)}")
    if signed_with(req, secret, also) is None:
        raise AuthError("bad request signature")
    if is_mine is not None and not is_mine(req.target):
        raise AuthError(f"request was signed for {req.target}, not for this side channel (relayed?)")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if abs(now - req.ts_ms) > MAX_SKEW_MS:
        raise AuthError(
            f"request made {(now - req.ts_ms) / 1e3:.0f} s from now: stale or replayed, or clocks differ"
        )


def signed_with(req: SignedRequest, secret: bytes, also: bytes | None = None) -> bytes | None:
    """Which of ``secret`` and ``also`` made ``req``'s signature (None: neither): the reply is sealed
    under that one, the only one the requester is sure to hold."""
    for key in (secret, also):
        if key and req.auth is not None and hmac.compare_digest(req.auth, _mac(req, key)):
            return key
    return None


class ReplayGuard:
    """Remembers the last ``capacity`` accepted nonces and refuses a repeat (bounded memory)."""

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity <= 0:
            raise ConfigError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, req: SignedRequest) -> None:
        """Call after ``verify``: raise ``AuthError`` if this nonce was accepted before, else remember it."""
        if req.nonce is None:
            raise AuthError("request has no nonce")
        if req.nonce in self._seen:
            raise AuthError("replayed request (nonce already used)")
        self._seen[req.nonce] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
