"""An engine server in a fleet: its etcd record, and how SIGTERM drains it.

With ``--discovery``, the engine registers once its HTTP API serves (``Registrar``: a lease of
``--discovery-ttl`` seconds, renewed three times per TTL with the live load) and deregisters when it stops.

SIGTERM (first one) drains instead of stopping at once: the record and ``/health`` say ``draining`` (the
router stops choosing the engine), the engine keeps serving what arrives for ``DRAIN_GRACE_S`` (requests a
router picked before it saw the mark), then waits until nothing is live and no finished prefill still holds
blocks for a decode engine (P's pushes are done), at most ``--drain-timeout`` seconds; then it revokes its
lease and uvicorn stops. A second SIGTERM or SIGINT stops at once. Without ``--discovery`` SIGTERM stops
as before (uvicorn finishes the HTTP requests it has): static routers poll ``/health`` on their own clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvwire.apikey import MAX_BODY_BYTES
from kvwire.discovery.record import EngineRecord, FleetRole, RecordLoad, SideChannel
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.source import open_store
from kvwire.engine.server import EngineServer, http_error
from kvwire.errors import EngineOverloaded

log = logging.getLogger(__name__)

DRAIN_GRACE_S = (
    0.5  # a watching router sees the draining mark within milliseconds; this covers a pick in flight
)
_IDLE_POLL_S = 0.05


def engine_record(server: EngineServer, url: str) -> EngineRecord:
    """The record of this engine now (its load changes; the rest is fixed for its life)."""
    ident, cfg, load = server.identity, server.engine.cfg, server.engine.load()
    mode = ident.mode
    host, port = ident.side_channel_host, ident.side_channel_port
    ranks = tuple(SideChannel(pp, tp, host, port) for pp in range(cfg.pp_size) for tp in range(cfg.tp_size))
    return EngineRecord(
        role=FleetRole(ident.role.value),
        engine_id=ident.engine_id,
        incarnation=ident.incarnation,
        model=ident.model,
        url=url,
        side_channel_host=host,
        side_channel_port=port,
        compat=ident.compat,  # the handshake's: equal hashes pair (kvwire.router.engines.compat_problem)
        side_channels=ranks,
        tp_size=cfg.tp_size,
        pp_size=cfg.pp_size,
        seed=ident.seed,
        mode=mode.value if mode is not None else None,
        authenticated=ident.authenticated,
        load=RecordLoad(**load.report()),
        kv_blocks=server.engine.kv.allocator.num_blocks,
        block_size=server.engine.kv.spec.block_size,
        draining=server.draining,
        updated=time.time(),
    )


def idle(server: EngineServer) -> bool:
    """Nothing live, and no finished prefill holding blocks for a decode engine."""
    acc = server.accounting()
    return bool(acc["requests"]["live"] == 0 and acc["requests"]["held"] == 0)


class Fleet:
    """The registrar of one engine server and its drain."""

    def __init__(self, server: EngineServer, discovery: str, url: str, ttl_s: int, drain_timeout_s: float):
        self.server = server
        self.url = url
        client = open_store(discovery)
        self.registrar = Registrar(client, lambda: engine_record(server, url), ttl_s)
        self.drain_timeout_s = drain_timeout_s
        self.refusing = False  # past a drain's grace: new work is refused (``_RefuseWhenDrained``)

    def install(self, app: FastAPI) -> None:
        """Register once the app serves, deregister when it stops (wraps the app's lifespan); refuse new
        work once a drain's grace is over."""
        app.add_middleware(_RefuseWhenDrained, fleet=self)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
            async with inner(a) as state:
                self.registrar.start()
                try:
                    yield state
                finally:
                    await self.registrar.close()

        app.router.lifespan_context = lifespan

    async def drain(self) -> float:
        """Stop taking work, finish what is here; returns the seconds it took."""
        start = time.monotonic()
        self.server.draining = True
        log.info("draining: %s marked, finishing in-flight requests", self.url)
        await self.registrar.drain()
        await asyncio.sleep(DRAIN_GRACE_S)
        self.refusing = True  # a request that arrives now was picked by no router that saw the mark
        deadline = start + self.drain_timeout_s
        while not idle(self.server) and time.monotonic() < deadline:
            await asyncio.sleep(_IDLE_POLL_S)
        if not idle(self.server):
            log.warning("drain timeout (%.0f s): stopping with requests still live", self.drain_timeout_s)
            # Ended by the engine, so their handlers answer its typed 503 (or an SSE error event) now:
            # left to uvicorn, they were cancelled at its shutdown (a bare 500, a stream cut mid-chunk).
            await asyncio.to_thread(self.server.stop)
            await asyncio.sleep(_IDLE_POLL_S)  # their answers go out before uvicorn stops
        await self.registrar.close()  # the record goes now, not after the lease's TTL
        took = time.monotonic() - start
        log.info("drained in %.2f s", took)
        return took


class _RefuseWhenDrained:
    """ASGI middleware: once a drain's grace is over, new completions get the engine's typed 503 (they were
    taken after the mark, and cut when the drain timed out). A decode leg that continues a transfer (its
    body names ``do_remote_prefill``) is no new work: in pull mode it comes only once P answered, maybe
    after the grace, and refusing it failed the request while P held its KV (found by a review). A plain
    ASGI class, not ``BaseHTTPMiddleware``, which wraps every response (streams included)."""

    def __init__(self, app: Any, fleet: Fleet) -> None:
        self.app, self.fleet = app, fleet

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (self.fleet.refusing and scope.get("method") == "POST" and path.startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        raw, more = b"", True
        while more and len(raw) <= MAX_BODY_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            raw, more = raw + message.get("body", b""), bool(message.get("more_body", False))
        if not more and b"do_remote_prefill" in raw:  # the handler judges it as any other
            replay = [{"type": "http.request", "body": raw, "more_body": False}]
            await self.app(scope, lambda: _next_message(replay, receive), send)
            return
        refusal = EngineOverloaded("the engine is draining (SIGTERM): send new requests to another engine")
        status, body, headers = http_error(refusal)
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


async def _next_message(replay: list[dict[str, Any]], receive: Any) -> Any:
    """The body read already, then what the client sends next (its disconnect)."""
    return replay.pop() if replay else await receive()


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains the engine (``Fleet.drain``) before stopping."""

    def __init__(self, config: uvicorn.Config, fleet: Fleet) -> None:
        super().__init__(config)
        self.fleet = fleet
        self._drain_asked = False
        self._draining: asyncio.Task[float] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_asked or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        self._drain_asked = True
        self._captured_signals.append(sig)
        loop = self._loop
        # A signal handler runs between bytecodes of the loop's own thread: schedule, do not await.
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self.fleet.drain())
        self._draining.add_done_callback(lambda _t: setattr(self, "should_exit", True))
