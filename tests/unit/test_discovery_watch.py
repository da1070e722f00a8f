"""The etcd watch against a scripted etcd on 127.0.0.1 that goes silent without closing anything (a host
that lost power, a partition dropping packets): the watcher must notice, list again, and stop saying it
is synced when the listing gets no answer either. ``-k "etcd or discovery"`` finds it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping

import pytest
from aiohttp import web

from kvwire.discovery.etcd import EtcdClient, EtcdUnavailable, parse_target
from kvwire.discovery.record import EngineRecord
from kvwire.discovery.watcher import FleetWatcher
from kvwire.testing.clock import until
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class SilentEtcd:
    """Answers listings until ``dead`` is set (then never); every watch says "created" and then nothing."""

    def __init__(self) -> None:
        self.dead = asyncio.Event()
        self.listings = 0
        self.watches = 0

    async def range(self, request: web.Request) -> web.Response:
        if self.dead.is_set():
            await asyncio.Event().wait()  # the request reached nobody: no answer, no reset
        self.listings += 1
        return web.json_response({"header": {"revision": "7"}, "kvs": []})

    async def watch(self, request: web.Request) -> web.StreamResponse:
        self.watches += 1
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(
            json.dumps({"result": {"header": {"revision": "7"}, "created": True}}).encode() + b"\n"
        )
        await asyncio.Event().wait()  # silent from here on
        return resp


async def test_a_silent_watch_is_lost_and_listed_again() -> None:
    etcd = SilentEtcd()
    app = web.Application()
    app.router.add_post("/v3/kv/range", etcd.range)
    app.router.add_post("/v3/watch", etcd.watch)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    views: list[Mapping[str, EngineRecord]] = []
    client = EtcdClient(parse_target(f"etcd://127.0.0.1:{port}/f"), timeout_s=0.3, watch_idle_s=0.2)
    watcher = FleetWatcher(client, views.append, retry_s=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        await until(
            lambda: etcd.watches >= 2, "a second watch"
        )  # the silent watch was given up and a new one opened
        assert etcd.listings >= 2 and watcher.resyncs >= 1
        assert watcher.synced.is_set()  # etcd answered the listing: quiet, not gone
        etcd.dead.set()
        await until(
            lambda: not watcher.synced.is_set(), "the view unsynced"
        )  # now the listing gets no answer: not synced
    finally:
        watcher.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        await runner.cleanup()


class ScriptedGateway:
    """etcd's JSON gateway answering each path with the body given (bytes as they are, or JSON), and a
    watch stream of the lines given, then silent."""

    def __init__(self) -> None:
        self.bodies: dict[str, object] = {}
        self.lines: list[bytes] = []

    async def answer(self, request: web.Request) -> web.Response:
        return web.json_response(self.bodies[request.path])

    async def watch(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for line in self.lines:
            await resp.write(line)
        await asyncio.Event().wait()
        return resp


async def _gateway(gw: ScriptedGateway) -> tuple[web.AppRunner, int]:
    app = web.Application()
    for path in ("/v3/lease/grant", "/v3/lease/keepalive", "/v3/kv/range"):
        app.router.add_post(path, gw.answer)
    app.router.add_post("/v3/watch", gw.watch)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def test_malformed_gateway_answers_are_etcd_unavailable_naming_the_call() -> None:
    """Each shape below raised ValueError, TypeError, AttributeError or KeyError out of the client (logged
    as a traceback at every retry, the router's last_error empty), and a value that is not base64 read
    as b"". A watch line over aiohttp's own 512 KiB (one revision deleting 4,096 records) raised its
    LineTooLong, no ClientError, and ended the watch."""
    gw = ScriptedGateway()
    runner, port = await _gateway(gw)
    client = EtcdClient(parse_target(f"etcd://127.0.0.1:{port}/f"), timeout_s=2.0, watch_idle_s=5.0)
    try:
        cases = [
            ("/v3/lease/grant", {"ID": "abc", "TTL": "5"}, client.grant(5), "lease grant"),
            ("/v3/lease/keepalive", {"result": []}, client.keepalive(1), "lease keep-alive"),
            ("/v3/kv/range", {"kvs": [1]}, client.get_prefix("/f"), "listing"),
            ("/v3/kv/range", {"header": "h"}, client.get_prefix("/f"), "listing"),
            ("/v3/kv/range", {"kvs": [{"key": "L2Y=", "value": "%%%"}]}, client.get_prefix("/f"), "listing"),
            ("/v3/kv/range", {"kvs": ["junk"]}, client.get("/f/x"), "get"),
        ]
        for path, body, call, what in cases:
            gw.bodies[path] = body
            with pytest.raises(EtcdUnavailable, match=f"etcd {what}: malformed answer"):
                await call
        gw.bodies["/v3/lease/grant"] = {"ID": "7587", "TTL": "5"}  # the gateway's strings for int64
        assert await client.grant(5) == (7587, 5)
        url = "/f/engines/decode/http%3A%2F%2F10.0.{}.{}%3A8000"  # a record's key, as the registrar writes it
        keys = [base64.b64encode(url.format(i // 256, i % 256).encode()).decode() for i in range(4096)]
        revisions = {"mod_revision": "1234567", "create_revision": "1234000"}
        events = [{"type": "DELETE", "kv": {"key": key, **revisions}} for key in keys]
        gw.lines = [json.dumps({"result": {"events": events}}).encode() + b"\n"]
        assert len(gw.lines[0]) > 512 << 10
        got = []
        async for ev in client.watch("/f", 1):
            got.append(ev)
            if len(got) == 4096:
                break
        assert got[0].value is None and got[-1].key == url.format(15, 255) and got[-1].revision == 1234567
    finally:
        await client.close()
        await runner.cleanup()
