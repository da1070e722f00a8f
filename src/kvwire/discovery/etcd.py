"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client port), on aiohttp; plain
HTTP (``etcd://``) or TLS (``etcds://``, with the CA that signed etcd's certificate and, for an etcd run
with ``--client-cert-auth``, this client's certificate and key: ``?ca=PATH&cert=PATH&key=PATH``). An etcd
with authentication on takes a user (``etcd://USER@HOST:PORT``) whose password is in
``KVWIRE_ETCD_PASSWORD``: the client authenticates for a token and sends it with every call, and
authenticates again when etcd says the token expired or predates a change of users or roles.

Why not a gRPC client (``aetcd``, ``etcd3aio``): they bring ``grpcio`` and ``protobuf``, which a vLLM
process already pins to its own versions (the connector runs inside vLLM), and their reconnect behaviour is
hidden in the channel. The gateway ships with every etcd 3.x server, speaks the same API (leases,
keep-alive, range, put, delete, watch) and needs only aiohttp, which kvwire already uses. Every call has a
timeout and every failure is one ``EtcdUnavailable``: callers (``Registrar``, ``FleetWatcher``) retry.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvwire.discovery.etcd_answers import (
    EtcdUnavailable,
    Grant,
    KeepAlive,
    Range,
    WatchLine,
    typed,
    unb64,
)
from kvwire.discovery.source import Source, WatchEvent, redact
from kvwire.discovery.source import WatchIdle as SourceWatchIdle
from kvwire.errors import ConfigError

DEFAULT_PREFIX = "/kvwire"
ENV_PASSWORD = "KVWIRE_ETCD_PASSWORD"
# A watch line is one JSON object per event batch; a fleet's records are a few hundred bytes each.
_MAX_LINE = 4 << 20


class EtcdAuthFailed(EtcdUnavailable):
    """etcd refused the user's password (or knows no such user); retried like any refusal, and logged."""


class WatchIdle(EtcdUnavailable, SourceWatchIdle):
    """The watch stream said nothing for ``watch_idle_s``: etcd may be gone without a word (power loss, a
    partition dropping packets), or only quiet. The caller lists again, which tells the two apart."""


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: the CA bundle that signed its certificate (None: the system's), and this client's
    certificate and key when etcd checks clients (``--client-cert-auth``)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        """The client's TLS context (``ssl.SSLError`` / ``OSError`` when a file cannot be loaded)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def query(self) -> str:
        parts = [(k, v) for k, v in (("ca", self.ca), ("cert", self.cert), ("key", self.key)) if v]
        return "?" + urllib.parse.urlencode(parts) if parts else ""


@dataclass(frozen=True)
class EtcdTarget:
    """Where the fleet lives: ``etcd://HOST:PORT[/prefix]``, or ``etcds://...`` over TLS."""

    host: str
    port: int
    prefix: str = DEFAULT_PREFIX
    tls: EtcdTls | None = None
    user: str | None = None  # etcd's authentication (password: KVWIRE_ETCD_PASSWORD)
    password: str | None = field(default=None, repr=False)

    @property
    def _netloc(self) -> str:
        # An IPv6 literal goes in brackets (``etcd://[::1]:2379``): bare, ``::1:2379`` is not an address.
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self._netloc}"

    def __str__(self) -> str:
        who = f"{urllib.parse.quote(self.user, safe='')}@" if self.user else ""
        if self.tls is None:
            return f"etcd://{who}{self._netloc}{self.prefix}"
        return f"etcds://{who}{self._netloc}{self.prefix}{self.tls.query()}"


def parse_target(text: str, environ: Mapping[str, str] | None = None) -> EtcdTarget:
    """``etcd://[USER@]HOST:PORT[/prefix]`` (``ConfigError`` otherwise), USER's password from
    ``KVWIRE_ETCD_PASSWORD`` in ``environ`` (the process's by default). Errors never echo credentials."""
    shown = redact(text)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("etcd", "etcds") or not parts.netloc:
        raise ConfigError(f"--discovery {shown!r}: expected etcd://HOST:PORT[/prefix] (etcds:// for TLS)")
    user, password = _credentials(shown, parts, os.environ if environ is None else environ)
    if "," in parts.netloc:
        raise ConfigError(
            f"--discovery {shown!r}: one etcd endpoint only: for a multi-member etcd, give the address "
            "of a load balancer or a DNS name in front of the members (docs/fleet.md)"
        )
    if not parts.hostname:
        raise ConfigError(f"--discovery {shown!r}: expected etcd://HOST:PORT[/prefix]")
    try:
        port = 2379 if parts.port is None else parts.port
    except ValueError:
        raw = parts.netloc.rpartition(":")[2]
        why = "out of range (1-65535)" if raw.isdigit() else "not a number"
        raise ConfigError(f"--discovery {shown!r}: the port is {why}") from None
    if port == 0:  # taken for "no port" before, and 2379 dialled instead
        raise ConfigError(f"--discovery {shown!r}: the port is out of range (1-65535)")
    prefix = parts.path.rstrip("/") or DEFAULT_PREFIX
    tls = _tls(shown, parts) if parts.scheme == "etcds" else None
    if tls is None and parts.query:
        raise ConfigError(f"--discovery {shown!r}: query parameters (ca, cert, key) are for etcds:// (TLS)")
    return EtcdTarget(parts.hostname, port, prefix, tls, user, password)


def _credentials(
    shown: str, parts: urllib.parse.SplitResult, environ: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """The user of ``etcd://USER@...`` and its password (``KVWIRE_ETCD_PASSWORD``); a password in the
    URL is refused: it would show in process lists, shell history and every log that prints the URL."""
    if "@" not in parts.netloc:
        return None, None
    userinfo = parts.netloc.rpartition("@")[0]
    if ":" in userinfo:
        raise ConfigError(
            f"--discovery {shown!r}: a password in the URL is refused (it shows in process lists and logs): "
            f"give etcd://USER@HOST:PORT and the password in {ENV_PASSWORD}"
        )
    user = urllib.parse.unquote(userinfo)
    if not user:
        raise ConfigError(f"--discovery {shown!r}: an empty user before '@'")
    # Checked when a client is made (``EtcdClient``), not here: vLLM's workers parse the same settings
    # and never talk to etcd, so a worker node needs no password.
    return user, environ.get(ENV_PASSWORD) or None


def _tls(shown: str, parts: urllib.parse.SplitResult) -> EtcdTls:
    """``etcds://``'s ``?ca=&cert=&key=``: each a readable file, loaded once here (``ConfigError`` naming
    the file that cannot be, at start-up rather than at the first call to etcd). Values are percent-decoded
    as URL paths are (``%26`` for ``&``); ``+`` stays ``+`` (not form encoding); an empty one is refused
    (an unset shell variable must not turn into "no client certificate")."""
    got: dict[str, str] = {}
    for part in parts.query.split("&") if parts.query else []:
        name, eq, value = part.partition("=")
        if name not in ("ca", "cert", "key") or name in got or not eq:
            raise ConfigError(f"--discovery {shown!r}: {name!r} unknown or repeated (ca, cert, key)")
        if not value:
            raise ConfigError(f"--discovery {shown!r}: {name}= is empty")
        got[name] = urllib.parse.unquote(value)
    if ("cert" in got) != ("key" in got):
        raise ConfigError(f"--discovery {shown!r}: a client certificate needs both cert= and key=")
    for name, path in got.items():
        if not os.path.isfile(path):
            raise ConfigError(f"--discovery {shown!r}: {name}={path} is not a readable file")
    tls = EtcdTls(got.get("ca"), got.get("cert"), got.get("key"))
    try:
        tls.context()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"--discovery {shown!r}: cannot load the TLS files: {exc}") from None
    return tls


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


class EtcdClient:
    """One session to one etcd endpoint. Not thread-safe: use it from one event loop."""

    def __init__(self, target: EtcdTarget, timeout_s: float = 2.0, watch_idle_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        # A watch line (event or progress notification) at least this often, or the stream counts as lost.
        self.watch_idle_s = watch_idle_s
        if target.user is not None and not target.password:
            raise ConfigError(
                f"--discovery {target}: etcd user {target.user!r} needs its password in {ENV_PASSWORD} "
                "(set, not empty)"
            )
        self._session: aiohttp.ClientSession | None = None
        self._ssl = target.tls.context() if target.tls is not None else None
        self._token: str | None = None  # etcd's auth token for target.user, once authenticated
        self.authentications = 0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            tls = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(connector=tls)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One unary gateway call, e.g. ``call("/v3/kv/put", {...})``; with a user, with its token (taken
        again, and the call made once more, when etcd says the token expired or is stale)."""
        status, raw = await self._post(path, body, await self._auth())
        if self.target.user is not None and _stale_token(status, raw):
            self._token = None
            status, raw = await self._post(path, body, await self._auth())
        if status != 200:
            raise EtcdUnavailable(f"etcd {path}: HTTP {status}: {raw[:200]!r}{self._hint(status, raw)}")
        try:
            out = json.loads(raw)
        except ValueError as exc:
            raise EtcdUnavailable(f"etcd {path}: not JSON: {exc}") from exc
        if not isinstance(out, dict):
            raise EtcdUnavailable(f"etcd {path}: not a JSON object")
        return out.get("result", out) if path == "/v3/lease/keepalive" else out

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout_s):
                url = self.target.base_url + path
                async with self._http().post(url, data=json.dumps(body), headers=headers) as resp:
                    return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EtcdUnavailable(f"etcd at {self.target.base_url}: {type(exc).__name__} {exc}") from exc

    async def _auth(self) -> dict[str, str]:
        """The headers of an authenticated call (none without a user): authenticates when no token is held."""
        user, password = self.target.user, self.target.password
        if user is None or password is None:
            return {}
        if self._token is None:
            status, raw = await self._post("/v3/auth/authenticate", {"name": user, "password": password}, {})
            try:
                token = json.loads(raw).get("token") if status == 200 else None
            except (ValueError, AttributeError):
                token = None
            if not isinstance(token, str) or not token:
                raise EtcdAuthFailed(
                    f"etcd at {self.target.base_url} refused user {user!r} (HTTP {status}: {raw[:160]!r}): "
                    f"check the user and {ENV_PASSWORD}, and that etcd has authentication on"
                )
            self._token = token
            self.authentications += 1
        return {"Authorization": self._token}

    def _hint(self, status: int, raw: bytes = b"") -> str:
        if status == 400 and b"user name is empty" in raw:
            return (f" (etcd has authentication on: give --discovery etcd://USER@{self.target.host}:"
                    f"{self.target.port} and the password in {ENV_PASSWORD}, docs/fleet.md)")  # fmt: skip
        if status == 403 and self.target.user is not None:
            p = self.target.prefix
            return (f" (etcd user {self.target.user!r} may not use the prefix: grant its role readwrite on "
                    f"keys {p!r} to {prefix_end(p)!r}, docs/fleet.md)")  # fmt: skip
        return ""

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (at least its minimum TTL, whatever was asked)."""
        out = typed("lease grant", await self.call("/v3/lease/grant", {"TTL": ttl_s}), Grant)
        if out.error or not out.ID:
            raise EtcdUnavailable(f"etcd refused a lease: {out.error or 'no lease id'}")
        return out.ID, out.TTL or ttl_s

    async def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL; 0 when etcd no longer knows it (it expired: grant a new one)."""
        out = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return typed("lease keep-alive", out, KeepAlive).TTL

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": base64.b64encode(value).decode()}
        if lease:
            body["lease"] = str(lease)
        await self.call("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key)})

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and its lease (0: none), None when absent (a range read: no revision)."""
        kvs = typed("get", await self.call("/v3/kv/range", {"key": _b64(key)}), Range).kvs
        if not kvs:
            return None
        return unb64("get", kvs[0].value), kvs[0].lease

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """Every key under ``prefix`` and the store's revision at that moment."""
        out = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        listing = typed("listing", out, Range)
        return listing.header.revision, {_key(kv.key): unb64("listing", kv.value) for kv in listing.kvs}

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` on, until the stream breaks
        (``EtcdUnavailable``). A compacted start revision also ends it: the caller lists again."""
        create = {
            "key": _b64(prefix),
            "range_end": _b64(prefix_end(prefix)),
            "start_revision": start_revision,
            # A server run with --experimental-watch-progress-notify-interval below watch_idle_s keeps a
            # quiet stream alive; without it a quiet fleet costs one listing per watch_idle_s.
            "progress_notify": True,
        }
        url = self.target.base_url + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self.timeout_s)
        headers = await self._auth()
        try:
            async with self._http().post(
                url, data=json.dumps({"create_request": create}), timeout=timeout, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise EtcdUnavailable(f"etcd watch: HTTP {resp.status}")
                async for line in self._lines(resp):
                    try:
                        events = _events(json.loads(line))
                    except EtcdUnavailable:
                        # A stale token cancels the watch at once (permission denied): take a new one
                        # for the listing the caller makes next.
                        self._token = None
                        raise
                    for event in events:
                        yield event
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise EtcdUnavailable(
                f"etcd watch at {self.target.base_url}: {type(exc).__name__} {exc}"
            ) from exc

    async def _lines(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The watch stream's lines, each at most ``_MAX_LINE`` bytes. Split here, not by aiohttp's
        ``readline``: its own bound (512 KiB) came first and raised ``LineTooLong``, no ``ClientError``:
        one revision deleting a full fleet's records (4,096 events, 548 KB) ended the watch with a
        traceback (found by a review)."""
        buf = bytearray()
        while True:
            end = buf.find(b"\n")
            if end >= 0:
                line = bytes(buf[: end + 1])
                del buf[: end + 1]
                yield line
                continue
            if len(buf) > _MAX_LINE:
                raise EtcdUnavailable(f"etcd watch: a line over {_MAX_LINE} bytes")
            try:
                async with asyncio.timeout(self.watch_idle_s):
                    chunk = await resp.content.readany()
            except TimeoutError:
                raise WatchIdle(f"etcd watch: nothing for {self.watch_idle_s:g} s") from None
            if not chunk:
                raise EtcdUnavailable("etcd closed the watch stream")
            buf += chunk


def _stale_token(status: int, raw: bytes) -> bool:
    """etcd's answer to a token it no longer takes: expired or unknown (401), or issued before a change of
    users or roles (400, "revision of auth store is old"); etcd's own clients authenticate again on both."""
    return status == 401 or (status == 400 and b"revision of auth store is old" in raw)


def _events(message: Any) -> list[WatchEvent]:
    """One line of the watch stream as events (``EtcdUnavailable`` for an error or a cancelled watch)."""
    if not isinstance(message, dict) or message.get("error"):
        detail = message.get("error") if isinstance(message, dict) else message
        raise EtcdUnavailable(f"etcd watch error: {str(detail)[:200]}")
    result = typed("watch", message, WatchLine).result
    if result.canceled or result.compact_revision:
        raise EtcdUnavailable(f"etcd cancelled the watch: {result.cancel_reason or 'compacted'}")
    return [
        WatchEvent(
            _key(ev.kv.key), None if ev.type == "DELETE" else unb64("watch", ev.kv.value), ev.kv.mod_revision
        )
        for ev in result.events
    ]


def _key(b64: str) -> str:
    """A key as text. Anyone who can write under the prefix may write a key that is not UTF-8: it becomes
    a key no record matches (skipped and counted by the watcher), never an error that stops the listing."""
    return unb64("key", b64).decode(errors="replace")


def open_store(text: str, timeout_s: float = 2.0) -> EtcdClient:
    """``kvwire.discovery.source``'s entry: a client of ``etcd://HOST:PORT[/prefix]`` (``etcds://``: TLS)."""
    return EtcdClient(parse_target(text), timeout_s)


SOURCE = Source("etcd", parse_target, open_store, also=("etcds",))
