"""A vLLM engine's registration from ``kv_connector_extra_config`` (``discovery``), without vLLM: the
settings, the record (one side channel per rank, as vLLM listens), and the background registrar against
a real etcd, seen by the router's watcher as a ``--engines vllm`` engine (``-k "etcd or discovery"``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvwire.config import EngineKind
from kvwire.discovery.etcd import EtcdClient, parse_target
from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.discovery.watcher import FleetWatcher
from kvwire.errors import ConfigError
from kvwire.integrations.vllm.discovery import start_registration, vllm_record
from kvwire.integrations.vllm.params import KvRole, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine
from kvwire.router.engines import EngineRegistry
from kvwire.router.fleet import FleetDiscovery
from kvwire.router.http import EngineClient
from kvwire.router.policy import Role
from kvwire.testing.etcd import EtcdServer


def _local(engine_id: str) -> LocalEngine:
    return LocalEngine(engine_id, "127.0.0.1", 5700, 1, 1, "i")


def test_discovery_vllm_settings_and_record() -> None:
    extra = {"discovery": "etcd://127.0.0.1:2379/f", "discovery_url": "http://127.0.0.1:8100/",
             "side_channel_port": 5700}  # fmt: skip
    s = settings_from_extra(extra)
    rec = vllm_record(s, KvRole.PRODUCER, LocalEngine("prefill-0", "127.0.0.1", 5700, 2, 1, "inc"), "m")
    assert (rec.role, rec.url, rec.side_channel_port) == (FleetRole.PREFILL, "http://127.0.0.1:8100", 5700)
    assert [(c.tp_rank, c.port) for c in rec.side_channels] == [(0, 5700), (1, 5701)]
    with pytest.raises(ConfigError):
        vllm_record(s, KvRole.BOTH, _local("e"), "m")
    for bad in ({"discovery": "etcd://h:1"}, {"discovery": "zk://h:1", "discovery_url": "http://x:1"}):
        with pytest.raises(ConfigError):
            settings_from_extra(bad)
    assert start_registration(settings_from_extra({}), KvRole.PRODUCER, lambda: _local("e"), "m") is None


def test_discovery_vllm_engine_registers_for_a_vllm_router(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as etcd:
        extra = {"discovery": etcd.url, "discovery_url": "http://127.0.0.1:8101", "side_channel_port": 5710}
        local = LocalEngine("prefill-v", "127.0.0.1", 5710, 1, 1, "inc-1")
        reg = start_registration(settings_from_extra(extra), KvRole.PRODUCER, lambda: local, "m")
        assert reg is not None
        try:
            asyncio.run(asyncio.wait_for(_router_sees(etcd.url), 20))
        finally:
            reg.close()
        asyncio.run(asyncio.wait_for(_gone(etcd.url), 20))


async def _router_sees(target: str) -> None:
    registry = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0, EngineKind("vllm"))
    fleet = FleetDiscovery(target, registry)
    await fleet.start(first_view_s=5.0)
    try:
        deadline = time.monotonic() + 5.0
        while not registry.engines[Role.PREFILL] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        state = registry.get("http://127.0.0.1:8101")
        # What a #engine_id=...&side_channel=... fragment used to say, from the record instead.
        assert state.static is not None
        assert (state.static.engine_id, state.static.side_channel_port) == ("prefill-v", 5710)
        assert state.static.incarnation == "inc-1" and state.healthy
    finally:
        await fleet.close()


async def _gone(target: str) -> None:
    seen: list[Mapping[str, EngineRecord]] = []
    watcher = FleetWatcher(EtcdClient(parse_target(target)), seen.append)
    task = asyncio.create_task(watcher.run())
    await watcher.synced.wait()
    assert seen[-1] == {}  # shutdown revoked the lease: the record is gone at once
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await watcher.client.close()
