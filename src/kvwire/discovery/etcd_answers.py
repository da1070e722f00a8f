"""etcd's JSON answers (its gRPC gateway, v3 API) as typed messages: a malformed one is ``EtcdUnavailable``
naming the call, never a ``KeyError`` or ``AttributeError`` from deep in a parser.

The gateway writes 64-bit integers as JSON strings (``"ID": "7587..."``) and bytes as base64: the
structs take both forms of a number (``strict=False``), and ``unb64`` refuses what is not base64 (it
decoded to ``b""`` before). A review fed a fake gateway's bodies to every call: each raised something
else (``ValueError``, ``TypeError``, ``AttributeError``, ``KeyError``), logged as a traceback at every
retry, and the router's ``last_error`` named no cause.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, TypeVar

import msgspec

from kvwire.discovery.source import SourceUnavailable

T = TypeVar("T")


class EtcdUnavailable(SourceUnavailable):
    """etcd did not answer, or answered with an error or something unusable (the caller keeps its last
    state and retries)."""


class Header(msgspec.Struct, forbid_unknown_fields=False):
    revision: int = 0


class Grant(msgspec.Struct, forbid_unknown_fields=False):
    ID: int = 0
    TTL: int = 0
    error: str = ""


class KeepAlive(msgspec.Struct, forbid_unknown_fields=False):
    TTL: int = 0


class KeyValue(msgspec.Struct, forbid_unknown_fields=False):
    key: str = ""
    value: str = ""
    lease: int = 0
    mod_revision: int = 0


class Range(msgspec.Struct, forbid_unknown_fields=False):
    header: Header = msgspec.field(default_factory=Header)
    kvs: list[KeyValue] = msgspec.field(default_factory=list)


class Event(msgspec.Struct, forbid_unknown_fields=False):
    type: str = "PUT"
    kv: KeyValue = msgspec.field(default_factory=KeyValue)


class WatchResult(msgspec.Struct, forbid_unknown_fields=False):
    events: list[Event] = msgspec.field(default_factory=list)
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""


class WatchLine(msgspec.Struct, forbid_unknown_fields=False):
    result: WatchResult = msgspec.field(default_factory=WatchResult)
    error: Any = None


def typed(what: str, answer: object, kind: type[T]) -> T:
    """``answer`` (decoded JSON) as ``kind``; ``EtcdUnavailable`` naming ``what`` and the field when its
    shape is not etcd's."""
    try:
        return msgspec.convert(answer, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise EtcdUnavailable(f"etcd {what}: malformed answer: {exc}") from None


def unb64(what: str, text: str) -> bytes:
    """etcd's base64 field; ``EtcdUnavailable`` when it is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EtcdUnavailable(
            f"etcd {what}: malformed answer: a key or value is not base64 ({exc})"
        ) from None
