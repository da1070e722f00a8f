"""The side-channel server: one asyncio TCP listener per engine, serving each local rank's metadata.

Theory of operation. A client connects, sends ``get_metadata`` frames (wire contract v1) and reads one
reply per request: ``metadata`` for a rank this engine serves, else ``error``. A ``notif_only`` request
gets the agent's connection-only metadata and no regions (a peer that only sends notifications needs no
descriptors, so the reply stays small whatever the cache size); a full request gets the full agent
metadata and every region of that rank's cache. Several requests may share one connection (the client
takes clock samples that way).

Every refusal is an ``error`` frame, never a crash: ``bad_request`` for a frame that does not decode (the
connection is then closed, since the stream is out of sync), ``incompatible`` for a newer wire version,
``unauthorized`` when a shared secret is set and the request's HMAC is missing, wrong or replayed,
``no_such_rank``. With a secret, every reply to a verified request goes ``sealed`` (encrypted and bound to
that request, ``protocol/seal.py``). Connections are bounded: an idle timeout and a request count per
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvwire.config import WILDCARD_HOSTS
from kvwire.errors import AuthError, ConfigError, KvwireError, ProtocolError, VersionMismatch
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.protocol.auth import ReplayGuard, SignedRequest, signed_with, verify
from kvwire.protocol.codec import (
    FRAME_HEADER_BYTES,
    decode_side,
    encode_body,
    encode_frame,
    parse_frame_header,
)
from kvwire.protocol.compat import compat_fields, compat_hash
from kvwire.protocol.messages import (
    Ack,
    Claim,
    CompatFields,
    ErrorCode,
    ErrorReply,
    GetMetadata,
    Granted,
    KVInfo,
    Metadata,
    RegionMsg,
    ReportFailed,
    Sealed,
)
from kvwire.protocol.seal import ReplySeal

log = logging.getLogger("kvwire.handshake")
_Reply = Metadata | ErrorReply | Ack | Granted
_R = TypeVar("_R", Metadata | ErrorReply, Ack | ErrorReply, Granted | ErrorReply, _Reply)
# P's connector's verdict on a ``claim``: granted, or the refusal (its code and why).
ClaimVerdict = Granted | tuple[ErrorCode, str]

DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_MAX_REQUESTS = 64
# Open connections at most, in all and from one peer address: a peer holding connections open (refused
# requests keep one alive) cannot exhaust the listener's sockets or starve other peers.
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_CONNECTIONS_PER_HOST = 32
# From accept to a connection's first complete request: a real requester sends it at once (its handshake
# is a few ms), so an idle or trickling connection is closed long before it could be renewed at scale.
DEFAULT_FIRST_REQUEST_TIMEOUT_S = 2.0
_ACCEPT_STEPS = 3  # loop steps from an accepted socket to connection_made (see _stop_accepting)


@dataclass
class ServerStats:
    """Counters of one side-channel server."""

    connections: int = 0
    refused_connections: int = 0  # over max_connections (in all or from one host): closed at once
    # Idle connections that were not authenticated, closed to admit a new one over a limit.
    evicted_connections: int = 0
    authenticated_connections: int = 0  # moved to the authenticated budget (with a secret)
    replies: Counter[str] = field(default_factory=Counter)  # "metadata" | "notif_only" | ErrorCode value


@dataclass(eq=False)
class _Conn:
    """One accepted connection, as the limits see it."""

    host: str
    writer: asyncio.StreamWriter
    opened: float
    counted: bool = True  # counts against its host's budget (until a request on it is authenticated)
    # Between requests (from accept on: a new connection has sent nothing): evictable unless authenticated.
    waiting: bool = True
    # Reading a frame's body since ``frame_at`` (a trickle: evictable after idle ones; never while served).
    reading: bool = False
    frame_at: float = 0.0
    task: asyncio.Task[None] | None = None


def engine_compat_hash(engine: EngineInfo) -> str:
    return compat_hash(model_id=engine.model_id, spec=engine.spec, transfer_mode=engine.transfer_mode)


def engine_compat_fields(engine: EngineInfo) -> CompatFields:
    return compat_fields(model_id=engine.model_id, spec=engine.spec, transfer_mode=engine.transfer_mode)


def _kv_info(rank: LocalRank) -> KVInfo:
    spec = rank.cache.spec
    return KVInfo(
        num_layers=rank.cache.num_layers,
        first_layer=rank.cache.first_layer,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        block_size=spec.block_size,
        layout=spec.layout.value,
        mla=spec.mla,
        kv_fused=spec.kv_fused,
        kv_tiles=spec.kv_tiles,
        layer_groups=list(spec.layer_groups),
        group_windows=list(spec.group_windows),
    )


def _regions(rank: LocalRank) -> list[RegionMsg]:
    return [
        RegionMsg(
            layer=r.layer,
            kind=r.kind.value,
            base_addr=r.base_addr,
            block_len=r.block_len,
            num_blocks=r.num_blocks,
            device_id=r.device_id,
        )
        for r in rank.cache.regions()
    ]


class SideChannelServer:
    """Serves the metadata of every local (pp, tp) rank of this engine."""

    def __init__(
        self,
        engine: EngineInfo,
        ranks: Sequence[LocalRank],
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        *,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_requests_per_conn: int = DEFAULT_MAX_REQUESTS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_host: int = DEFAULT_MAX_CONNECTIONS_PER_HOST,
        first_request_timeout_s: float = DEFAULT_FIRST_REQUEST_TIMEOUT_S,
        on_report: Callable[[ReportFailed], None] | None = None,
        on_claim: Callable[[Claim], ClaimVerdict] | None = None,
        clock: Callable[[], float] = time.monotonic,
        accept_secret: bytes | None = None,
    ) -> None:
        self._ranks = {(r.pp_rank, r.tp_rank): r for r in ranks}
        # Takes an authenticated ``report_failed`` (D's connector; runs on the server's loop). None: this
        # engine takes none (P, or a bare metadata server).
        self.on_report = on_report
        # Judges an authenticated ``claim`` (a pull-mode P's connector; same loop). None: takes none.
        self.on_claim = on_claim
        if len(self._ranks) != len(ranks):
            raise ConfigError("two local ranks share a (pp, tp) rank")
        self.engine = engine
        self.compat_hash = engine_compat_hash(engine)
        self.compat_fields = engine_compat_fields(engine)
        self._host = host
        self._port = port
        self._secret = secret or None
        # A second secret taken too (KVWIRE_SECRET_ACCEPT: the cluster's secret being rotated); a reply
        # is sealed under the one that signed its request.
        self._also = (accept_secret or None) if self._secret else None
        self._replays = ReplayGuard() if self._secret else None
        self._seal = ReplySeal(self._secret) if self._secret else None
        self._also_seal = ReplySeal(self._also) if self._also else None
        self._idle_timeout_s = idle_timeout_s
        self._first_timeout_s = min(first_request_timeout_s, idle_timeout_s)
        self._max_requests = max_requests_per_conn
        self._max_conns = max_connections
        self._max_per_host = max_connections_per_host
        self._per_host: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        # Handler tasks and their writers are tracked from the moment a connection is accepted: a
        # handler cancelled before its first step never runs its ``finally``, so close() must close the
        # writer itself, or the socket is left to the GC (a ResourceWarning).
        self._clock = clock  # when a connection opened (the oldest idle one is evicted first)
        self._conns: dict[asyncio.Task[None], _Conn] = {}
        self._late: list[asyncio.StreamWriter] = []  # connections that arrived while closing
        self._closing = False
        # A rank's cache never moves (one slab for its life), so its regions are built once.
        self._region_msgs: dict[tuple[int, int], list[RegionMsg]] = {}
        self.stats = ServerStats()

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        if self._server is not None:
            return self._port
        self._closing = False
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        log.debug("side channel of %s listening on %s:%d", self.engine.engine_id, self._host, self._port)
        return self._port

    async def close(self) -> None:
        """Stop listening and drop open connections, every accepted socket closed; idempotent."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            await self._stop_accepting(server)
            server.close()
        conns = dict(self._conns)
        for task in conns:
            task.cancel()
        if conns:
            await asyncio.gather(*conns, return_exceptions=True)
        for writer in [*(c.writer for c in conns.values()), *self._late]:
            await self._close_writer(writer)
        self._late.clear()
        if server is not None:
            await server.wait_closed()

    @staticmethod
    async def _stop_accepting(server: asyncio.Server) -> None:
        """Stop polling the listener, then let connections the loop already accepted reach ``_accept``.

        asyncio builds an accepted connection in a task, then calls connection_made a step later; a
        listener closed in between makes it drop the half-built transport with its socket open (3.11's
        ``Server._attach`` asserts), which only the GC finds. Once the listener is no longer polled,
        ``_ACCEPT_STEPS`` loop steps bring every such connection to ``_accept``, which closes it.
        """
        loop = asyncio.get_running_loop()
        for sock in server.sockets:
            with contextlib.suppress(NotImplementedError, ValueError, OSError):
                loop.remove_reader(sock.fileno())
        for _ in range(_ACCEPT_STEPS):
            await asyncio.sleep(0)

    @staticmethod
    async def _close_writer(writer: asyncio.StreamWriter) -> None:
        writer.close()  # idempotent: a handler that ran has closed it already
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            await writer.wait_closed()

    async def __aenter__(self) -> SideChannelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections -----------------------------------------------------------------------------------

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Called synchronously when a connection is made: the handler task is tracked before it runs."""
        if self._closing:
            writer.close()
            self._late.append(writer)  # close() waits for it
            return
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._make_room(host):
            self.stats.refused_connections += 1
            writer.close()
            return
        self._per_host[host] += 1
        conn = _Conn(host, writer, self._clock())
        task = asyncio.get_running_loop().create_task(self._on_connect(reader, conn))
        conn.task = task
        self._conns[task] = conn
        task.add_done_callback(self._forget_conn)

    def _make_room(self, host: str) -> bool:
        """Whether a new connection from ``host`` fits, after evicting (if it must) the oldest idle
        connection not yet authenticated, of that host or of any: holding connections open then never
        keeps a newcomer out, and an authenticated peer's connections are never evicted."""
        if self._per_host[host] >= self._max_per_host and not self._evict(host):
            return False
        return len(self._conns) < self._max_conns or self._evict(None)

    def _evict(self, host: str | None) -> bool:
        """Evict one connection not yet authenticated: the oldest idle one, else the one whose frame's body
        began first (a client sends a frame in milliseconds: one that trickles its bytes holds its slot at
        most until a newcomer needs it). One being answered is never evicted."""
        open_ = [c for c in self._conns.values() if c.counted and (host is None or c.host == host) and c.task]
        idle = [c for c in open_ if c.waiting]
        reading = [c for c in open_ if c.reading]
        if idle:
            victim = min(idle, key=lambda c: c.opened)
        elif reading:
            victim = min(reading, key=lambda c: c.frame_at)
        else:
            return False
        assert victim.task is not None
        self._conns.pop(victim.task)
        self._uncount(victim)
        victim.task.cancel()
        victim.writer.close()  # here too: a handler cancelled before its first step never runs its finally
        self.stats.evicted_connections += 1
        return True

    def _uncount(self, conn: _Conn) -> None:
        if conn.counted:
            conn.counted = False
            self._per_host[conn.host] -= 1
            if self._per_host[conn.host] <= 0:
                del self._per_host[conn.host]

    def _forget_conn(self, task: asyncio.Task[None]) -> None:
        conn = self._conns.pop(task, None)
        if conn is not None:
            self._uncount(conn)

    def _authenticated(self, conn: _Conn) -> None:
        """A request on ``conn`` proved the secret: from now on it counts against the total only, never
        against its host's budget, and is never evicted."""
        if conn.counted:
            self._uncount(conn)
            self.stats.authenticated_connections += 1

    async def _on_connect(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        self.stats.connections += 1
        writer = conn.writer
        try:
            await self._serve(reader, conn)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or idled out: nothing to answer
        except Exception:  # a bug must cost one connection, never the listener
            log.exception("side channel of %s: connection handler failed", self.engine.engine_id)
        finally:
            await self._close_writer(writer)

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        writer = conn.writer
        for served in range(self._max_requests):
            # The first request has a short deadline from accept, header and body together.
            # Any later one may wait the idle timeout to begin, then has that short deadline for its body.
            limit = self._first_timeout_s if served == 0 else self._idle_timeout_s
            try:
                async with asyncio.timeout(limit):
                    conn.waiting = True
                    header = await self._read(reader, FRAME_HEADER_BYTES, at_start=True)
                    conn.waiting, conn.reading, conn.frame_at = False, True, self._clock()
                    if header is None:
                        return
                    async with asyncio.timeout(self._first_timeout_s):
                        body = await self._read(reader, parse_frame_header(header), at_start=False)
                    conn.reading = False
                assert body is not None
                msg = decode_side(body)
            except ProtocolError as exc:
                # The stream is out of sync after a bad frame: answer, then close.
                await self._send(writer, self._error_for(exc))
                return
            if not isinstance(msg, ReportFailed | GetMetadata | Claim):
                await self._send(
                    writer, self._refuse(ErrorCode.BAD_REQUEST, f"{type(msg).__name__} is no request")
                )
                return
            reply: _Reply = self._trusting(conn, self._reply_to(msg))
            await self._send(writer, self.sealed(msg, reply))
            if isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNAUTHORIZED:
                return  # no second try on a connection that could not prove the secret: its slot goes

    def _reply_to(self, msg: ReportFailed | GetMetadata | Claim) -> _Reply:
        if isinstance(msg, ReportFailed):
            return self.report(msg)
        return self.claim(msg) if isinstance(msg, Claim) else self.answer(msg)

    def _trusting(self, conn: _Conn, reply: _R) -> _R:
        """With a secret, a request that was not refused as unauthorized proved it (``answer`` and
        ``report`` verify before anything else): its connection joins the authenticated budget."""
        unauthorized = isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNAUTHORIZED
        if self._secret is not None and not unauthorized:
            self._authenticated(conn)
        return reply

    async def _read(self, reader: asyncio.StreamReader, n: int, *, at_start: bool) -> bytes | None:
        """Exactly ``n`` bytes, or None on a clean EOF between frames."""
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                return await reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            if at_start and not exc.partial:
                return None
            raise

    async def _send(self, writer: asyncio.StreamWriter, reply: _Reply | Sealed) -> None:
        writer.write(encode_frame(reply))
        async with asyncio.timeout(self._idle_timeout_s):
            await writer.drain()

    # -- answers (no I/O) ------------------------------------------------------------------------------

    def _refuse(self, code: ErrorCode, message: str) -> ErrorReply:
        self.stats.replies[code.value] += 1
        log.debug("side channel of %s refused a request: %s (%s)", self.engine.engine_id, code.value, message)
        return ErrorReply(code=code, message=message)

    def _error_for(self, exc: ProtocolError) -> ErrorReply:
        if isinstance(exc, VersionMismatch):
            return self._refuse(ErrorCode.INCOMPATIBLE, str(exc))
        return self._refuse(ErrorCode.BAD_REQUEST, str(exc))

    def _is_mine(self, target: str) -> bool:
        """Whether a request signed for ``target`` (host:port as the requester dialled it) is for us."""
        host, _, port = target.rpartition(":")
        if port != str(self._port):
            return False
        # Bound to every interface: the requester may have dialled any of our addresses.
        return self._host in WILDCARD_HOSTS or host.strip("[]") == self._host

    def sealed(self, req: SignedRequest, reply: _Reply) -> _Reply | Sealed:
        """With a secret, the reply to a verified request goes sealed (``protocol/seal.py``): readable only
        by a holder of the secret, and only as the answer to that request; a ``report_failed``'s refusals
        too (docs/protocol.md §4: only ``unauthorized`` and the refusals of undecodable frames go plain).
        A refusal of the request's credentials stays plain: it cannot be bound to a request that was not
        verified, and grants nothing; so does a report's ``ack`` (a claim's ``granted`` grants a read: it
        goes sealed)."""
        if self._seal is None or isinstance(reply, Ack):
            return reply
        if isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNAUTHORIZED:
            return reply
        seal = self._seal
        if self._also_seal is not None and self._secret and signed_with(req, self._secret) is None:
            seal = self._also_seal  # verified, not by our signing secret: by the accepted one
        return seal.seal(encode_body(reply), req)

    def _unauthorized(self, req: SignedRequest) -> ErrorReply | None:
        try:
            verify(req, self._secret, is_mine=self._is_mine, also=self._also)
            if self._replays is not None:
                self._replays.check(req)
        except AuthError as exc:
            return self._refuse(ErrorCode.UNAUTHORIZED, str(exc))
        return None

    def report(self, req: ReportFailed) -> Ack | ErrorReply:
        """Take a peer's ``report_failed`` (authenticated as a metadata request) for one of our ranks."""
        refused = self._unauthorized(req)
        if refused is not None:
            return refused
        if self.on_report is None:
            return self._refuse(ErrorCode.BAD_REQUEST, f"{self.engine.engine_id} takes no report_failed")
        if (req.pp_rank, req.tp_rank) not in self._ranks:
            return self._refuse(
                ErrorCode.NO_SUCH_RANK,
                f"{self.engine.engine_id} serves no rank pp{req.pp_rank}/tp{req.tp_rank}",
            )
        if req.to_incarnation != self.engine.incarnation:
            # Meant for an earlier life at this address (a restart): nothing of it lives here.
            detail = f"report for life {req.to_incarnation[:64]!r}, not this one"
            return self._refuse(ErrorCode.BAD_REQUEST, detail)
        self.stats.replies["report"] += 1
        self.on_report(req)
        return Ack()

    def claim(self, req: Claim) -> Granted | ErrorReply:
        """Judge a D's ``claim`` on one of our ranks' blocks (pull mode): the connector says."""
        refused = self._unauthorized(req)
        if refused is not None:
            return refused
        if self.on_claim is None:
            return self._refuse(
                ErrorCode.BAD_REQUEST, f"{self.engine.engine_id} takes no claim (not a pull P)"
            )
        if (req.pp_rank, req.tp_rank) not in self._ranks:
            return self._refuse(
                ErrorCode.NO_SUCH_RANK,
                f"{self.engine.engine_id} serves no rank pp{req.pp_rank}/tp{req.tp_rank}",
            )
        if req.to_incarnation != self.engine.incarnation:
            # An earlier life lent them (a restart since): this one holds nothing of that request.
            return self._refuse(ErrorCode.GONE, f"claim for life {req.to_incarnation[:64]!r}, not this one")
        verdict = self.on_claim(req)
        if isinstance(verdict, Granted):
            self.stats.replies["granted"] += 1
            return verdict
        return self._refuse(*verdict)

    def answer(self, req: GetMetadata) -> Metadata | ErrorReply:
        """The reply to one decoded request."""
        refused = self._unauthorized(req)
        if refused is not None:
            return refused
        rank = self._ranks.get((req.pp_rank, req.tp_rank))
        if rank is None:
            return self._refuse(
                ErrorCode.NO_SUCH_RANK,
                f"{self.engine.engine_id} serves no rank pp{req.pp_rank}/tp{req.tp_rank} "
                f"(pp_size {self.engine.pp_size}, tp_size {self.engine.tp_size})",
            )
        try:
            return self._metadata(rank, notif_only=req.notif_only)
        except KvwireError as exc:  # e.g. the rank's agent is closed: it cannot be loaded by anyone
            return self._refuse(
                ErrorCode.NO_SUCH_RANK, f"rank pp{req.pp_rank}/tp{req.tp_rank} unavailable: {exc}"
            )

    def _regions_of(self, rank: LocalRank) -> list[RegionMsg]:
        key = (rank.pp_rank, rank.tp_rank)
        if key not in self._region_msgs:
            self._region_msgs[key] = _regions(rank)
        return self._region_msgs[key]

    def _metadata(self, rank: LocalRank, *, notif_only: bool) -> Metadata:
        engine = self.engine
        md = Metadata(
            engine_id=engine.engine_id,
            incarnation=engine.incarnation,
            compat_hash=self.compat_hash,
            tp_size=engine.tp_size,
            tp_rank=rank.tp_rank,
            pp_size=engine.pp_size,
            pp_rank=rank.pp_rank,
            agent_name=rank.agent.name,
            agent_metadata=rank.agent.conn_metadata() if notif_only else rank.agent.metadata(),
            kv=_kv_info(rank),
            num_blocks=rank.cache.num_blocks,
            regions=[] if notif_only else self._regions_of(rank),
            server_time=time.time(),
            notif_only=notif_only,
            compat=self.compat_fields,
        )
        self.stats.replies["notif_only" if notif_only else "metadata"] += 1
        return md
