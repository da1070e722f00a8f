"""API keys of the HTTP servers (engines and router): ``Authorization: Bearer <key>`` on every ``/v1`` call.

As vLLM's ``--api-key``: ``/health`` and ``/metrics`` stay open to probes and scrapers; the key is compared
in constant time (``hmac.compare_digest``), so the answer's timing tells nothing of it.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"


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
