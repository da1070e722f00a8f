"""API keys of the HTTP servers (engines and router): ``Authorization: Bearer <key>`` on every ``/v1`` call.

As vLLM's ``--api-key``: ``/health`` and ``/metrics`` stay open to probes and scrapers; the key is compared
in constant time (``hmac.compare_digest``), so the answer's timing tells nothing of it.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"
# The router's legs carry its token here: with ``--router-token`` set, an engine takes kv_transfer_params
# (which name a peer to dial, and a transfer to join) only from a request that carries it.
ROUTER_TOKEN_HEADER = "x-kvwire-router-token"


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
