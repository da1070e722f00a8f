"""Scripted HTTP engines for router unit tests: every request goes to one handler the test writes.

Real servers on 127.0.0.1 (the router's HTTP client is exercised as in production, sockets included):
``scripted_app`` makes the ASGI app, ``ServerThread`` (``fake_engines``) runs it beside a router on a
background loop, and ``serving_here`` runs it on the test's own loop, where the handler may wait on the
test's asyncio events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

_START_POLL_S = 0.01
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Seen:
    """One request a scripted engine received."""

    method: str
    url: str  # scheme://host:port of the engine, as the router names it
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Handler = Callable[[Seen], Awaitable[tuple[int, Any]]]


def scripted_app(handler: Handler) -> FastAPI:
    """An app answering every GET and POST with ``handler``'s (status, JSON body)."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def any_path(request: Request, path: str) -> Response:
        base = f"{request.url.scheme}://{request.url.hostname}:{request.url.port}"
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen = Seen(request.method, base, "/" + path, headers, await request.body())
        status, body = await handler(seen)
        return JSONResponse(body, status_code=status)

    return app


@asynccontextmanager
async def serving_here(apps: Sequence[tuple[Any, int]]) -> AsyncIterator[None]:
    """Serve ``(app, port)`` pairs on 127.0.0.1 from the running loop until the block ends."""
    servers = [
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        for app, port in apps
    ]
    # Servers started as tasks install no signal handlers outside the main thread; on it, uvicorn
    # restores the previous handlers when each stops.
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    try:
        for _ in range(int(_START_TIMEOUT_S / _START_POLL_S)):
            if all(s.started for s in servers) or any(t.done() for t in tasks):
                break
            await asyncio.sleep(_START_POLL_S)
        if not all(s.started for s in servers):
            raise RuntimeError("scripted engines did not start")
        yield
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
