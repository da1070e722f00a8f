"""A discovery source: a store of leased records under a prefix, listed and followed; the one interface
``Registrar`` (engines publish) and ``FleetWatcher`` (the router follows) use.

``--discovery`` is a URL whose scheme names the source; ``SOURCES`` maps each scheme to its module, which
ends with ``SOURCE = Source(scheme, parse_target, open_store)``: ``parse_target(text)`` (``ConfigError`` on
a bad URL) and ``open_store(text, timeout_s)``, typed, so mypy checks a new source's store against
``Store``. A module is imported on first use (etcd's client loads aiohttp). Adding a source (Consul,
Kubernetes endpoints) is its module plus one line here (``docs/architecture.md``'s recipe). etcd is the one
today (``discovery/etcd.py``). Engines the router is given by URL (``--prefill``/``--decode``) need no
source: the router polls them (``kvwire.router.engines``).
"""

from __future__ import annotations

import importlib
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from kvwire.errors import ConfigError, KvwireError

# scheme -> the module of that source. One line per source.
SOURCES: dict[str, str] = {
    "etcd": "kvwire.discovery.etcd",
    "etcds": "kvwire.discovery.etcd",  # etcd over TLS
}


class SourceUnavailable(KvwireError):
    """The source did not answer, or answered with an error (the caller keeps its last state and retries)."""


class WatchIdle(SourceUnavailable):
    """The watch said nothing for too long: the source may be gone without a word (power loss, a partition
    dropping packets), or only quiet. The caller lists again, which tells the two apart."""


@dataclass(frozen=True)
class WatchEvent:
    key: str
    value: bytes | None  # None: the key was deleted (or its lease expired)
    revision: int


class Target(Protocol):
    """Where the fleet lives in a source; ``str()`` is its URL."""

    @property
    def prefix(self) -> str: ...


class Store(Protocol):
    """What the registrar and the watcher need of a source. Every failure is one ``SourceUnavailable``."""

    @property
    def target(self) -> Target: ...

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of ``ttl_s`` seconds: its id and the TTL the source granted (etcd raises a TTL
        below its minimum, 2 s by default, without a word: the lease then lives longer than asked)."""
        ...

    async def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL; 0 when the source no longer knows it (it expired: grant a new one)."""
        ...

    async def revoke(self, lease: int) -> None: ...

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        """Write ``key`` (gone when ``lease`` expires, when given)."""
        ...

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and the lease it lives under (0: none); None when the key is absent. A read:
        no new revision, no event for anyone watching."""
        ...

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """Every key under ``prefix`` and the store's revision at that moment."""
        ...

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` on; ``WatchIdle`` when it falls silent."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Source:
    """One discovery source: its URL scheme, how its URLs are checked, how a store is opened."""

    scheme: str
    parse_target: Callable[[str], Target]
    open_store: Callable[[str, float], Store]
    also: tuple[str, ...] = ()  # other schemes it takes (etcd's TLS one, etcds)

    @property
    def schemes(self) -> tuple[str, ...]:
        return (self.scheme, *self.also)


def redact(text: str) -> str:
    """``text`` with any ``user:password@`` replaced by ``***@``: what logs and errors may show."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    rest, query_mark, query = rest.partition("?")  # an '@' in a query (a file name) is not a user's
    netloc, slash, path = rest.partition("/")
    path += query_mark + query
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def _source(text: str) -> Source:
    scheme = urllib.parse.urlsplit(text).scheme
    module = SOURCES.get(scheme)
    if module is None:
        forms = ", ".join(f"{s}://..." for s in SOURCES)
        raise ConfigError(f"--discovery {redact(text)!r}: expected one of {forms}")
    source = getattr(importlib.import_module(module), "SOURCE", None)
    if not isinstance(source, Source) or scheme not in source.schemes:
        raise ConfigError(f"{module}.SOURCE is not the Source of scheme {scheme!r}")
    return source


def check_target(text: str, *, client: bool = False) -> None:
    """``ConfigError`` when ``text`` is no source's URL (start-up checks it before anything listens);
    with ``client``, also when this process could not make its client (credentials from the environment:
    a process that registers or watches checks them, one that only parses the settings does not)."""
    source = _source(text)
    source.parse_target(text)
    if client:
        source.open_store(text, 1.0)  # no I/O until its first call


def open_store(text: str, timeout_s: float = 2.0) -> Store:
    """A client of the source ``text`` names (not connected yet: its first call connects)."""
    return _source(text).open_store(text, timeout_s)
