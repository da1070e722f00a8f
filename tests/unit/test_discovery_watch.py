"""The etcd watch against a scripted etcd on 127.0.0.1 that goes silent without closing anything (a host
that lost power, a partition dropping packets): the watcher must notice, list again, and stop saying it
is synced when the listing gets no answer either. ``-k "etcd or discovery"`` finds it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest
from aiohttp import web

from kvwire.discovery.etcd import EtcdClient, parse_target
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
