"""Discovery on a real etcd with authentication on (users, roles, a password per user): an engine
registers and a router's watcher follows as a user whose role may use only the fleet's prefix; a token
etcd no longer takes (garbage, or older than a change of users) is replaced and the call made again;
a wrong password, a user without permission on the prefix, and a password in the URL each get an error
naming the fix. Run them with ``-k "etcd or discovery"``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from kvwire.config import EngineKind
from kvwire.discovery.etcd import ENV_PASSWORD, EtcdAuthFailed, EtcdClient, EtcdUnavailable, parse_target
from kvwire.discovery.record import FleetRole, engine_key
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.source import check_target
from kvwire.discovery.watcher import FleetWatcher
from kvwire.errors import ConfigError
from kvwire.router.engines import EngineRegistry
from kvwire.router.fleet import FleetDiscovery
from kvwire.router.http import EngineClient
from kvwire.testing.clock import until
from kvwire.testing.etcd import EtcdServer, FleetView, engine_record

USERS = {"fleet": ("fleet-pw", "/auth"), "stranger": ("stranger-pw", "/elsewhere")}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd-auth")) as server:
        server.enable_auth(USERS)
        yield server


def _target(etcd: EtcdServer, user: str, prefix: str = "/auth") -> str:
    return f"etcd://{user}@127.0.0.1:{etcd.client_port}{prefix}"


def test_an_engine_registers_and_a_router_follows_as_a_user(etcd: EtcdServer) -> None:
    target = parse_target(_target(etcd, "fleet"), {ENV_PASSWORD: "fleet-pw"})
    assert str(target) == f"etcd://fleet@127.0.0.1:{etcd.client_port}/auth"  # never the password
    assert "fleet-pw" not in repr(target)

    async def body() -> None:
        reg_client, watch_client = EtcdClient(target), EtcdClient(target)
        reg = Registrar(reg_client, engine_record, ttl_s=3, interval_s=0.2)
        view = FleetView()
        watcher = FleetWatcher(watch_client, view)
        task = asyncio.create_task(watcher.run())
        reg.start()
        key = engine_key("/auth", FleetRole.PREFILL, "http://127.0.0.1:8100")
        try:
            await until(lambda: key in view.records, "the registration, as user fleet")
            assert view.records[key] == engine_record()
            # etcd's tokens live in its memory: a restart refuses every one (HTTP 401, "invalid auth
            # token"), as an expired one is. Both sides authenticate again and the view comes back.
            before = (reg_client.authentications, watch_client.authentications)
            await asyncio.to_thread(etcd.stop)
            await asyncio.to_thread(etcd.start)
            await until(lambda: reg_client.authentications > before[0], "the registrar's new token", 15.0)
            await until(lambda: watch_client.authentications > before[1], "the watcher's new token", 15.0)
            await until(lambda: reg.registered.is_set() and key in view.records, "the record, again", 15.0)
            await reg.close()
            await until(lambda: not view.records, "the deregistration", timeout_s=3.0)
        finally:
            watcher.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await reg_client.close()
            await watch_client.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_token_etcd_refuses_is_replaced_and_the_call_made_again(etcd: EtcdServer) -> None:
    async def body() -> None:
        client = EtcdClient(parse_target(_target(etcd, "fleet"), {ENV_PASSWORD: "fleet-pw"}))
        try:
            await client.put("/auth/x", b"1")
            assert client.authentications == 1
            client._token = "not-a-token"  # as etcd sees an expired one: HTTP 401 "invalid auth token"
            await client.put("/auth/x", b"2")
            assert client.authentications == 2
            got = await client.get("/auth/x")
            assert got is not None and got[0] == b"2"
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_wrong_password_or_a_foreign_prefix_is_refused_naming_the_fix(etcd: EtcdServer) -> None:
    async def body() -> None:
        wrong = EtcdClient(parse_target(_target(etcd, "fleet"), {ENV_PASSWORD: "not-it"}))
        stranger = EtcdClient(parse_target(_target(etcd, "stranger"), {ENV_PASSWORD: "stranger-pw"}))
        anonymous = EtcdClient(parse_target(f"etcd://127.0.0.1:{etcd.client_port}/auth", {}))
        try:
            with pytest.raises(EtcdAuthFailed, match=f"refused user 'fleet'.*{ENV_PASSWORD}"):
                await wrong.put("/auth/x", b"1")
            with pytest.raises(EtcdUnavailable, match=r"HTTP 403.*grant its role readwrite on keys '/auth'"):
                await stranger.put("/auth/x", b"1")
            with pytest.raises(
                EtcdUnavailable, match=rf"HTTP 400.*user name is empty.*USER@.*{ENV_PASSWORD}"
            ):
                await anonymous.put("/auth/x", b"1")
        finally:
            for c in (wrong, stranger, anonymous):
                await c.close()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_router_refused_by_etcd_says_why(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router that never got its first listing logged nothing of the cause (a wrong password retried
    in silence); it now says it once per cause, and its summary carries it."""
    monkeypatch.setenv(ENV_PASSWORD, "not-it")

    async def body() -> None:
        registry = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0, EngineKind("kvwire"))
        fleet = FleetDiscovery(_target(etcd, "fleet"), registry)
        fleet.watcher.retry_s = 0.05
        with caplog.at_level(logging.WARNING, logger="kvwire"):
            await fleet.start(first_view_s=0.5)
            await until(lambda: fleet.watcher.last_error != "", "the first refusal")
            await asyncio.sleep(0.3)  # several retries: still one line for the one cause
        await fleet.close()
        lines = [r.getMessage() for r in caplog.records if "refused user 'fleet'" in r.getMessage()]
        assert len(lines) == 2  # the watcher's, and the start-up's "no answer yet (...)"
        assert ENV_PASSWORD in lines[0] and "not-it" not in " ".join(lines)
        assert "refused user 'fleet'" in str(fleet.summary()["last_error"])

    asyncio.run(asyncio.wait_for(body(), 20))


def test_credentials_are_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=f"password in the URL is refused.*{ENV_PASSWORD}") as bad:
        parse_target("etcd://fleet:secret@127.0.0.1:2379", {ENV_PASSWORD: "x"})
    assert "secret" not in str(bad.value)
    # A process that only parses the settings (vLLM's workers) needs no password; one that makes a
    # client (a registering engine, a router) does, at start.
    for env in ({}, {ENV_PASSWORD: ""}):
        target = parse_target("etcd://fleet@127.0.0.1:2379", env)
        with pytest.raises(ConfigError, match=f"user 'fleet' needs its password in {ENV_PASSWORD}"):
            EtcdClient(target)
    monkeypatch.delenv(ENV_PASSWORD, raising=False)
    check_target("etcd://fleet@127.0.0.1:2379")
    with pytest.raises(ConfigError, match=ENV_PASSWORD):
        check_target("etcd://fleet@127.0.0.1:2379", client=True)
    t = parse_target("etcds://a%40b@127.0.0.1:2379/p", {ENV_PASSWORD: "pw"})
    assert (t.user, t.password, t.prefix) == ("a@b", "pw", "/p")
