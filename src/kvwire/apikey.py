"""What the HTTP servers (engines and router) share at their door: API keys (``Authorization: Bearer <key>``
on every ``/v1`` call), the bounded read of a request body, and an answer given up when its client goes.

As vLLM's ``--api-key``: ``/health`` and ``/metrics`` stay open to probes and scrapers; the key is compared
in constant time (``hmac.compare_digest``), so the answer's timing tells nothing of it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"
# A prompt of max_model_len tokens as JSON token ids is well under 1 MiB; text prompts are of the same order.
MAX_BODY_BYTES = 16 << 20
# The router's legs carry its token here: with ``--router-token`` set, an engine takes kv_transfer_params
# (which name a peer to dial, and a transfer to join) only from a request that carries it.
ROUTER_TOKEN_HEADER = "x-kvwire-router-token"
# How often a request waiting for its answer checks that its client is still there (uvicorn does not cancel
# a plain handler when the client goes), and the status it then ends with: nginx's "client closed request",
# which nobody reads, but logs and metrics do. The engine and the router alike.
DISCONNECT_CHECK_S = 0.25
CLIENT_CLOSED = 499
# How long a cancelled answer (a router's leg) may take to close before the server stops waiting for it.
CANCEL_WAIT_S = 2.0
log = logging.getLogger("kvwire")


def router_token_header(token: str | None) -> dict[str, str]:
    return {ROUTER_TOKEN_HEADER: token} if token else {}


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def bearer(key: str | None) -> dict[str, str]:
    """The header a client of a server with ``key`` sends (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_matches(header: bytes, key: bytes) -> bool:
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def unauthorized_response(flag: str) -> JSONResponse:
    body = {
        "error": {
            "message": f"missing or wrong API key: send 'Authorization: Bearer <key>' with the key this "
            f"server was given ({flag})",
            "type": "authentication_error",
            "param": None,
            "code": 401,
        }
    }
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Refuses (401) a ``/v1`` request without the server's key."""

    def __init__(self, app: ASGIApp, key: str, flag: str = "--api-key") -> None:
        self.app = app
        self._key = key.encode()
        self._flag = flag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith(PROTECTED_PREFIX):
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value
            if not key_matches(given, self._key):
                await unauthorized_response(self._flag)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_bounded(http: Request, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The body, or None once it passes ``limit`` (refused, 400), instead of buffered whole: a router
    that read any size held 1 GiB for one 200 MiB post."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _openai_error(status: int, message: str, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def install_openai_refusals(app: FastAPI) -> None:
    """FastAPI's own refusals (an unknown path, a wrong method, a bad query parameter) and a bug's
    exception as OpenAI error objects, not ``{"detail": ...}`` (a client library reads ``error``)."""

    @app.exception_handler(StarletteHTTPException)
    async def http_refusal(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _openai_error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _openai_error(400, f"invalid request: {exc.errors()!r:.500}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        log.error("request raised", exc_info=exc)
        return _openai_error(500, f"internal error: {type(exc).__name__}", "internal_error")


async def unless_client_gone(request: Request, answer: Awaitable[Response]) -> Response:
    """``answer``, cancelled (a router's legs with it: the engines abort) once the client hangs up, then
    ``CLIENT_CLOSED``. uvicorn does not cancel a plain handler when its client goes: a client that left a
    2,500-token unary answer after 1.5 s still had D generate for 10 s through the router. A stream's
    answer returns at once; Starlette ends the stream."""
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_CHECK_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
                return Response(status_code=CLIENT_CLOSED)
    finally:
        if not task.done():
            task.cancel()
