"""A vLLM engine's etcd registration (``kv_connector_extra_config`` key ``discovery``).

vLLM's scheduler process builds the connector once; with ``"discovery": "etcd://HOST:PORT[/prefix]"`` and
``"discovery_url"`` (the URL vLLM's OpenAI server listens on: the connector cannot know it) it registers
the engine as the reference engines do (``kvwire.discovery``): role, engine id, incarnation, model, URL,
side channel per rank (vLLM: one port per rank), TP/PP. A router with ``--engines vllm --discovery`` then
needs no ``#engine_id=...&side_channel=...`` URL fragments. vLLM's queue and free blocks live in its
scheduler, out of the connector's sight: the record's load stays zero (the router counts its own
requests in flight). The registrar runs on a daemon thread with its own event loop; ``shutdown()``
revokes the lease, and a killed engine's record goes with its lease.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from kvwire.discovery.record import EngineRecord, FleetRole, SideChannel
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.source import open_store
from kvwire.errors import ConfigError
from kvwire.integrations.vllm.params import KvRole, Settings
from kvwire.integrations.vllm.scheduler import LocalEngine

_CLOSE_TIMEOUT_S = 5.0


def vllm_record(settings: Settings, kv_role: KvRole, local: LocalEngine, model: str) -> EngineRecord:
    """The record of a vLLM engine (``ConfigError`` when its settings cannot make one): each rank's side
    channel at its own host once the workers said where they are (a multi-node engine)."""
    if kv_role is KvRole.BOTH or not settings.discovery_url:
        raise ConfigError(
            "kv_connector_extra_config discovery: needs discovery_url (this server's http://HOST:PORT) and "
            "kv_role kv_producer or kv_consumer"
        )
    role = FleetRole.PREFILL if kv_role is KvRole.PRODUCER else FleetRole.DECODE
    tp, pp = local.tp_size, local.pp_size
    ranks = tuple(
        SideChannel(p, t, local.rank_host(p, t), settings.rank_port(p, t, tp))
        for p in range(pp)
        for t in range(tp)
    )
    return EngineRecord(
        role=role,
        engine_id=local.engine_id,
        incarnation=local.incarnation or "",
        model=model,
        url=settings.discovery_url.rstrip("/"),
        side_channel_host=local.host,
        side_channel_port=settings.side_channel_port,
        side_channels=ranks,
        tp_size=tp,
        pp_size=pp,
        mode=settings.mode.value,
        updated=time.time(),
    )


class BackgroundRegistrar:
    """A ``Registrar`` on its own thread and event loop (the scheduler process runs no loop of ours)."""

    def __init__(self, target: str, record: Callable[[], EngineRecord], ttl_s: int) -> None:
        self.client = open_store(target)
        self.registrar = Registrar(self.client, record, ttl_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwire-discovery", daemon=True)

    def start(self) -> BackgroundRegistrar:
        self._thread.start()
        self._ready.wait(_CLOSE_TIMEOUT_S)
        return self

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.registrar.start()
        self._ready.set()
        await self._stop.wait()
        await self.registrar.close()

    def close(self) -> None:
        """Deregister (revoke the lease) and stop the thread; bounded."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(_CLOSE_TIMEOUT_S)


def start_registration(
    settings: Settings, kv_role: KvRole, local: Callable[[], LocalEngine], model: str
) -> BackgroundRegistrar | None:
    """Register this engine when its settings ask for it (``discovery``); None otherwise. ``local`` is
    read at every renewal: the ranks' hosts arrive after the start (vLLM gathers them from the workers),
    and a changed record is written again."""
    if not settings.discovery:
        return None
    vllm_record(settings, kv_role, local(), model)  # refused now, in the engine's start, not in the thread
    return BackgroundRegistrar(
        settings.discovery, lambda: vllm_record(settings, kv_role, local(), model), settings.discovery_ttl_s
    ).start()
