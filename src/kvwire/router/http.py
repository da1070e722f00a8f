"""The router's HTTP client to its engines: both legs of every request, and the health polls in a pool of
their own.

aiohttp, not httpx: a router spends most of its CPU in its HTTP client, and on the short-request path that
CPU is latency (P, D and the router share the host's cores). Measured on this 2-core host against a
kvwire engine, one streamed one-token request: httpx 2.97-3.31 ms of client CPU, aiohttp 1.40-1.55 ms
(httpx goes through httpcore and anyio for every send; aiohttp parses in C).

The session is made on first use, inside the running loop (aiohttp binds a session to the loop that made
it), and closed with the router.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec

from kvwire.apikey import bearer, router_token_header

_JSON = {"Content-Type": "application/json"}
# The most an engine's answer may hold: a health or model list, or a whole unary completion (tokens,
# logprobs). An engine sending more is broken or hostile; its answer is refused, not buffered.
SMALL_BODY_LIMIT = 1 << 20
COMPLETION_BODY_LIMIT = 64 << 20
_READ_CHUNK = 1 << 16
# Health polls and model lists at once. A round polls every engine at once, and a poll's time includes its
# wait for a connection here: 256 engines that hang to the timeout together would make the rest of a
# larger fleet wait past theirs.
PROBE_CONNECTIONS = 256


class BodyTooLarge(ValueError):
    """An engine's answer over the limit for its kind."""


def parse_json(body: bytes) -> Any:
    """An engine's JSON; ``ValueError`` for anything malformed, too deep included (``json`` raises
    ``RecursionError`` for ``[[[...`` a few thousand deep, which passed every handler of a leg or a health
    check: the router answered 500, and a hostile /health left its engine marked healthy)."""
    try:
        return json.loads(body)
    except ValueError:
        raise ValueError("answer is not JSON") from None
    except RecursionError:
        raise ValueError("answer is not JSON (nested too deep)") from None


def json_object(body: bytes) -> dict[str, Any]:
    """An engine's JSON answer as an object; ``ValueError`` naming what it is instead."""
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise ValueError("answer is not a JSON object")
    return obj


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of ``resp``, or ``BodyTooLarge`` as soon as it passes ``limit`` bytes."""
    chunks, size = [], 0
    while chunk := await resp.content.read(_READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class EngineClient:
    """Connections to the engines, kept alive between requests (up to ``max_connections`` open)."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        api_key: str | None = None,
        max_connections: int = 512,
        router_token: str | None = None,
    ) -> None:
        # No total timeout here: the router bounds each request as a whole; this bounds each wait.
        self._timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        # The router token goes with legs only: a health poll or model list needs none, and the fewer
        # requests carry it, the fewer places it can leak to (any URL etcd names is polled). The API key
        # goes with the model list too (vLLM's /v1/models asks for it).
        self._headers = dict(_JSON)
        self._leg_headers = {**bearer(api_key), **router_token_header(router_token)}
        self._get_headers = bearer(api_key)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # Health polls and model lists have a pool of their own: in the legs' pool they waited behind
        # streams for a free connection, timed out, and marked healthy engines down (found by a review).
        self._probes: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The legs' session (``max_connections`` connections at most)."""
        if self._session is None or self._session.closed:
            self._session = self._new_session(self._max_connections)
        return self._session

    def probe_session(self) -> aiohttp.ClientSession:
        """The session of health polls and model lists (``PROBE_CONNECTIONS`` at most)."""
        if self._probes is None or self._probes.closed:
            self._probes = self._new_session(PROBE_CONNECTIONS)
        return self._probes

    def _new_session(self, limit: int) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300)
        return aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers, raise_for_status=False
        )

    def post(self, url: str, body: Mapping[str, object]) -> aiohttp.client._RequestContextManager:
        """POST ``body`` as JSON; use as ``async with client.post(...) as resp``."""
        return self.session().post(url, data=msgspec.json.encode(body), headers=self._leg_headers)

    async def get(self, url: str, timeout_s: float, api_key: bool = False) -> tuple[int, bytes]:
        """A small GET (health, model list): its status and body, within ``timeout_s`` in all.
        ``api_key``: send the API key (``/v1/...``; ``/health`` is open)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = self._get_headers if api_key else None
        async with self.probe_session().get(url, timeout=timeout, headers=headers) as resp:
            return resp.status, await read_bounded(resp, SMALL_BODY_LIMIT)

    async def close(self) -> None:
        for session in (self._session, self._probes):
            if session is not None and not session.closed:
                await session.close()
        # Lets the connectors' transports close before the loop does (aiohttp's documented advice).
        await asyncio.sleep(0)
        self._session = self._probes = None
