"""The router's side of discovery: etcd records in, the registry's discovered engines out.

Started by ``Router.start`` when ``--discovery etcd://...`` is given. The watcher (``kvwire.discovery``)
hands over the whole set of records after each change; each record becomes the ``HealthInfo`` its
``/health`` would give, so D's legs carry the identity of P's current life (engine id, incarnation, side
channel) as soon as it registered, never the previous one's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge

from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.discovery.source import open_store
from kvwire.discovery.watcher import FleetWatcher
from kvwire.protocol.messages import TransferMode
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.policy import Load, Role

log = logging.getLogger(__name__)

_ROLES = {FleetRole.PREFILL: Role.PREFILL, FleetRole.DECODE: Role.DECODE}


def health_info(rec: EngineRecord) -> HealthInfo:
    """What the router knows of an engine from its record (as from its ``/health``)."""
    try:
        mode = TransferMode(rec.mode) if rec.mode is not None else None
    except ValueError:
        mode = None
    return HealthInfo(
        role=rec.role.value,
        engine_id=rec.engine_id,
        incarnation=rec.incarnation,
        side_channel_host=rec.side_channel_host,
        side_channel_port=rec.side_channel_port,
        tp_size=rec.tp_size,
        pp_size=rec.pp_size,
        model=rec.model,
        load=Load(rec.load.running, rec.load.waiting, rec.load.free_blocks),
        seed=rec.seed,
        mode=mode,
        authenticated=rec.authenticated,
        compat=rec.compat,
        kv_tokens=rec.kv_blocks * rec.block_size,
        side_channel_hosts=rank_hosts(rec),
    )


def rank_hosts(rec: EngineRecord) -> tuple[str, ...]:
    """Each rank's host (rank (pp, tp) at ``pp * tp_size + tp``) when the record lists every rank and
    they are not all at ``side_channel_host``; () otherwise (one host, or a record listing no ranks)."""
    if len(rec.side_channels) != rec.tp_size * rec.pp_size:  # first: the sizes come from any record
        return ()
    hosts = {(c.pp_rank, c.tp_rank): c.host for c in rec.side_channels}
    ranks = [(p, t) for p in range(rec.pp_size) for t in range(rec.tp_size)]
    if set(hosts) != set(ranks):
        return ()
    out = tuple(hosts[r] for r in ranks)
    return out if any(h != rec.side_channel_host for h in out) else ()


class FleetDiscovery:
    """Keeps ``registry``'s discovered engines equal to the records under the etcd prefix."""

    def __init__(self, target: str, registry: EngineRegistry, timeout_s: float = 2.0) -> None:
        self.registry = registry
        self.client = open_store(target, timeout_s)
        self.watcher = FleetWatcher(self.client, self.apply)
        self._task: asyncio.Task[None] | None = None

    def apply(self, records: Mapping[str, EngineRecord]) -> None:
        found = {(_ROLES[r.role], r.url): health_info(r) for r in records.values()}
        draining = {r.url: r.draining for r in records.values()}
        self.registry.sync(found, draining)

    async def start(self, first_view_s: float) -> None:
        """Start watching; wait up to ``first_view_s`` for the first listing (etcd may be down: the
        router then starts with its static engines and takes the fleet when etcd answers)."""
        self._task = asyncio.create_task(self.watcher.run())
        try:
            await asyncio.wait_for(self.watcher.synced.wait(), timeout=first_view_s)
        except TimeoutError:
            why = f" ({self.watcher.last_error})" if self.watcher.last_error else ""
            log.warning("no answer from %s yet%s: starting without its engines", self.client.target, why)

    def gauges(self, registry: CollectorRegistry, model: str) -> None:
        """``kvwire_router_discovery_*`` on the router's ``/metrics`` (read from the watcher at scrape)."""
        labels = {"role": "router", "model_name": model}
        w = self.watcher
        figures: dict[str, tuple[str, Callable[[], float]]] = {
            "synced": (
                "1 while the view follows etcd (0: away, last view kept)",
                lambda: float(w.synced.is_set()),
            ),
            "engines": ("engine records in the view", lambda: float(len(w.records))),
            "resyncs": (
                "full listings after the first (etcd came back, or the watch broke)",
                lambda: w.resyncs,
            ),
            "rejected": (
                "values under the prefix refused (not a record, or not its key's)",
                lambda: w.rejected,
            ),
        }
        for name, (text, read) in figures.items():
            gauge = Gauge(f"kvwire_router_discovery_{name}", text, list(labels), registry=registry)
            gauge.labels(**labels).set_function(read)

    def summary(self) -> dict[str, object]:
        return {
            "target": str(self.client.target),
            "synced": self.watcher.synced.is_set(),
            "engines": len(self.watcher.records),
            "resyncs": self.watcher.resyncs,
            "rejected": self.watcher.rejected,
            "last_error": self.watcher.last_error,
        }

    async def close(self) -> None:
        self.watcher.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()
