"""The legs over a real socket: D's events parsed, the connection kept for the next request when the
stream ends at [DONE], dropped when the engine keeps sending after it; answers over their limit refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvwire.router import http, legs
from kvwire.router.engines import EngineRegistry
from kvwire.router.http import EngineClient
from kvwire.router.legs import _DRAIN_LIMIT, DecodeStream, LegError, post_completion
from kvwire.router.openai_api import ErrorType
from kvwire.router.policy import Role
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Engine:
    """An SSE engine on 127.0.0.1 that counts the connections it accepted."""

    def __init__(self) -> None:
        self.peers: set[tuple[str, int]] = set()
        self.trailing = b""  # sent after [DONE]
        self.hold_s = 0.0  # then this long before the body ends
        self.size = 100  # bytes of a unary answer
        self.events = [b'data: {"choices": [{"text": "a"}]}\n\n']
        self.tokens: list[str | None] = []  # the router token header of each leg
        self.done = b"data: [DONE]\n\n"  # how the body ends (b"": closed early, as a crashed handler)
        self.raw: bytes | None = None  # the unary answer's bytes as they are, instead of JSON

    async def unary(self, request: web.Request) -> web.Response:
        """A JSON answer of ``self.size`` bytes."""
        if self.raw is not None:
            return web.Response(body=self.raw, content_type="application/json")
        pad = "x" * max(0, self.size - 20)
        return web.json_response({"choices": [], "pad": pad})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer is not None:
            self.peers.add((str(peer[0]), int(peer[1])))
        self.tokens.append(request.headers.get("x-kvwire-router-token"))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in self.events:
            await resp.write(event)
        await resp.write(self.done + self.trailing)
        await asyncio.sleep(self.hold_s)
        await resp.write_eof()
        return resp


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    fake = Engine()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.handle)
    app.router.add_post("/unary/v1/completions", fake.unary)
    app.router.add_get("/health", fake.unary)
    app.router.add_get("/unary/health", fake.unary)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _stream_all(client: EngineClient, url: str) -> list[dict[str, object]]:
    stream = DecodeStream(client, url, {"prompt": "x"})
    events = []
    try:
        await stream.open()
        while (event := await stream.next_event()) is not None:
            events.append(event)
    finally:
        await stream.aclose()
    return events


async def test_a_stream_read_to_done_leaves_its_connection_for_the_next(engine: tuple[Engine, str]) -> None:
    fake, url = engine
    fake.hold_s = 0.05  # the body's end comes after [DONE]: the leg waits for it rather than drop it
    client = EngineClient(2.0, 5.0)
    try:
        for _ in range(3):
            assert await _stream_all(client, url) == [{"choices": [{"text": "a"}]}]
        assert len(fake.peers) == 1  # one connection served all three
    finally:
        await client.close()


async def test_an_engine_sending_after_done_loses_its_connection(
    engine: tuple[Engine, str],
) -> None:
    fake, url = engine
    fake.trailing, fake.hold_s = b": " + b"x" * (4 * _DRAIN_LIMIT) + b"\n", 1.0
    client = EngineClient(2.0, 5.0)
    try:
        for _ in range(2):
            assert await _stream_all(client, url) == [{"choices": [{"text": "a"}]}]
        assert len(fake.peers) == 2  # not drained past the limit: closed, a new one for the next
    finally:
        await client.close()


async def test_an_error_event_is_a_leg_error_naming_the_engine_message(engine: tuple[Engine, str]) -> None:
    fake, url = engine
    fake.events = [b'data: {"error": {"message": "kv lost", "type": "engine_error", "code": 503}}\n\n']
    client = EngineClient(2.0, 5.0)
    try:
        with pytest.raises(LegError, match="kv lost") as exc:
            await _stream_all(client, url)
        assert exc.value.status == 503
    finally:
        await client.close()


async def test_a_stream_closed_before_done_is_a_leg_error_not_a_whole_answer(
    engine: tuple[Engine, str],
) -> None:
    fake, url = engine
    fake.done = b""  # one event, then the body ends cleanly: an engine that gave up mid-answer
    client = EngineClient(2.0, 5.0)
    try:
        with pytest.raises(LegError, match=r"ended before \[DONE\]") as exc:
            await _stream_all(client, url)
        assert exc.value.kind is ErrorType.ENGINE_ERROR and exc.value.role is Role.DECODE
    finally:
        await client.close()


async def test_an_answer_over_the_limit_is_refused_not_buffered(
    engine: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = engine
    monkeypatch.setattr(legs, "COMPLETION_BODY_LIMIT", 1000)
    monkeypatch.setattr(http, "SMALL_BODY_LIMIT", 1000)
    client = EngineClient(2.0, 5.0)
    try:
        assert (await post_completion(client, Role.PREFILL, url + "/unary", {}))["choices"] == []
        fake.size = 5000
        with pytest.raises(LegError, match="answer over 1000 bytes") as exc:
            await post_completion(client, Role.PREFILL, url + "/unary", {})
        assert exc.value.kind is ErrorType.ENGINE_ERROR
        with pytest.raises(http.BodyTooLarge):
            await client.get(url + "/health", 2.0)
    finally:
        await client.close()


async def test_every_leg_carries_the_router_token(engine: tuple[Engine, str]) -> None:
    fake, url = engine
    for token in ("t0k3n", None):
        client = EngineClient(2.0, 5.0, router_token=token)
        try:
            assert await _stream_all(client, url) == [{"choices": [{"text": "a"}]}]
        finally:
            await client.close()
    assert fake.tokens == ["t0k3n", None]


async def test_json_nested_too_deep_is_the_engines_error_not_the_routers(engine: tuple[Engine, str]) -> None:
    """``[[[...`` 50,000 deep (50 KB, under every size limit) made ``json`` raise ``RecursionError``, which
    no handler of a leg or a health check caught: the router answered 500 instead of the engine's error,
    a stream was cut without an error event, and a /health answer like it left its engine marked healthy."""
    fake, url = engine
    deep = b"[" * 50_000
    fake.raw = deep
    fake.events = [b"data: " + deep + b"\n\n"]
    client = EngineClient(2.0, 5.0)
    registry = EngineRegistry(client, [url + "/unary"], [], timeout_s=2.0)
    state = registry.engines[Role.PREFILL][0]
    state.healthy = True
    try:
        with pytest.raises(LegError, match="nested too deep") as exc:
            await post_completion(client, Role.PREFILL, url + "/unary", {})
        assert exc.value.kind is ErrorType.ENGINE_ERROR
        with pytest.raises(LegError, match="bad SSE event") as exc:
            await _stream_all(client, url)
        assert exc.value.kind is ErrorType.ENGINE_ERROR and exc.value.role is Role.DECODE
        await registry.check(state)  # raised RecursionError, the state untouched
        assert not state.healthy and state.error == "answer is not JSON (nested too deep)"
    finally:
        await client.close()
