"""An engine's presence in etcd: its record under a lease, kept alive and refreshed with its load.

``run()`` loops until ``close()``: grant a lease (TTL ``ttl_s``), put the record under it, then every
``interval_s`` renew the lease and put the record again (the load changes). When etcd is unreachable the
engine keeps serving and the loop retries; when it answers again the lease is renewed if etcd still knows
it, else a new one is granted and the record written again: etcd coming back resyncs by itself.
``drain()`` rewrites the record with ``draining`` set (the router stops choosing the engine);
``close()`` revokes the lease, which deletes the record at once (not after the TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from kvwire.discovery.record import EngineRecord, encode, engine_key
from kvwire.discovery.source import SourceUnavailable, Store

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        client: Store,
        snapshot: Callable[[], EngineRecord],
        ttl_s: int = 5,
        interval_s: float | None = None,
    ) -> None:
        if ttl_s < 1:
            raise ValueError("the lease TTL is at least 1 s")
        self.client = client
        self.snapshot = snapshot
        self.ttl_s = ttl_s
        # Three renewals per TTL, each given at most the interval, and a failed one tried again within
        # 0.1 s: one lost renewal (refused, or hanging to the client timeout) never lets the lease expire.
        self.interval_s = interval_s if interval_s is not None else ttl_s / 3
        self.lease = 0
        self.draining = False
        self.registered = asyncio.Event()  # set once the record is in etcd (cleared while etcd is away)
        self.registrations = 0  # leases granted and records written: 1 + one per etcd loss of the lease
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._written: EngineRecord | None = None  # the last record put, ``updated`` zeroed
        self.puts = 0

    @property
    def key(self) -> str:
        rec = self.snapshot()
        return engine_key(self.client.target.prefix, rec.role, rec.url)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    def _record(self) -> EngineRecord:
        rec = self.snapshot()
        if self.draining and not rec.draining:
            rec = _with_draining(rec)
        return rec

    async def _put(self, force: bool) -> None:
        """Put the record, unless only its ``updated`` stamp changed since the last put: each put is an
        etcd revision and one event for every router watching (the keepalive alone keeps the lease)."""
        rec = self._record()
        content = msgspec.structs.replace(rec, updated=0.0)
        if not force and content == self._written:
            return
        await self.client.put(self.key, encode(rec), self.lease)
        self._written = content
        self.puts += 1

    async def _register(self) -> None:
        # A put that does not finish (a renewal's deadline) must not leave the record counted as written
        # under the new lease: the next renewal would see the lease alive and skip the unchanged record.
        self._written = None
        self.lease = await self.client.grant(self.ttl_s)
        await self._put(force=True)
        self.registrations += 1
        self.registered.set()
        log.info(
            "registered in %s as %s (lease %x, ttl %d s)",
            self.client.target,
            self.key,
            self.lease,
            self.ttl_s,
        )

    async def _renew(self) -> None:
        if not self.lease or await self.client.keepalive(self.lease) <= 0:
            if self.lease:
                log.warning("etcd lost this engine's lease %x: registering again", self.lease)
            await self._register()
            return
        await self._put(force=False)
        self.registered.set()

    async def run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                async with asyncio.timeout(self.interval_s):  # a hung call gives way to the next try
                    await self._renew()
                if failures:
                    log.info("etcd at %s answers again", self.client.target)
                failures = 0
            except (SourceUnavailable, TimeoutError) as exc:
                if not failures:
                    log.warning(
                        "etcd unreachable, serving on and retrying: %s",
                        str(exc) or "no answer within the interval",
                    )
                failures += 1
                self.registered.clear()
            except Exception:  # a bug here must not end the registration for good: log it, try again
                log.exception("registration failed")
                failures += 1
                self.registered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self._wait(failures))

    def _wait(self, failures: int) -> float:
        """Until the next try: the interval after a renewal; after a failed one 0.1 s, doubling with each
        failure in a row up to the interval (etcd down costs each engine a try per interval, not a storm)."""
        return self.interval_s if not failures else min(self.interval_s, 0.1 * 2 ** (failures - 1))

    async def drain(self) -> None:
        """Mark the record draining now (best effort: with etcd away the router's health checks see it)."""
        self.draining = True
        if self.lease:
            with contextlib.suppress(SourceUnavailable):
                await self._put(force=True)

    async def close(self) -> None:
        """Stop renewing and delete the record (revoking the lease); etcd being away is not an error."""
        self._stop.set()
        if self._task is not None:
            await self._task
        if self.lease:
            with contextlib.suppress(SourceUnavailable):
                await self.client.revoke(self.lease)
            self.lease = 0
        await self.client.close()


def _with_draining(rec: EngineRecord) -> EngineRecord:
    return msgspec.structs.replace(rec, draining=True)
