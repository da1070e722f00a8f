"""An engine's presence in etcd: its record under a lease, kept alive and refreshed with its load.

``run()`` loops until ``close()``: grant a lease (TTL ``ttl_s``), put the record under it, then every
``interval_s`` (a third of the TTL etcd granted) renew the lease, read the key back, and put the record
again when the load changed or someone deleted or overwrote it (a key held by another engine's live lease
is left alone and logged as an error: two engines advertise one URL). When etcd is unreachable the
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
from kvwire.discovery.record import decode as decode_record
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
        self.ttl_s = ttl_s  # asked for; ``granted_ttl_s`` is what the store granted (etcd raises a short one)
        self.granted_ttl_s = ttl_s
        self._fixed_interval = interval_s
        self.interval_s = interval_s if interval_s is not None else _interval(ttl_s)
        self.lease = 0
        self.foreign_lease = 0  # another live lease holding our key (two engines on one URL), else 0
        self.restores = 0  # records put again after someone deleted or overwrote them under a live lease
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
        self.lease, granted = await self.client.grant(self.ttl_s)
        self._granted(granted)
        self.foreign_lease = 0
        await self._put(force=True)
        self.registrations += 1
        self.registered.set()
        log.info(
            "registered in %s as %s (lease %x, ttl %d s)",
            self.client.target,
            self.key,
            self.lease,
            self.granted_ttl_s,
        )

    def _granted(self, ttl_s: int) -> None:
        """Renew on the granted TTL's schedule: etcd raises a TTL below its minimum (2 s by default, more
        with a long election timeout) without an error, and the engine must say so, not claim the TTL it
        asked for (a dead engine then stays in routers' views for the granted TTL, not the asked one)."""
        if ttl_s > self.ttl_s and ttl_s != self.granted_ttl_s:
            log.warning(
                "etcd granted a lease TTL of %d s, not the %d s asked (its minimum TTL): a dead engine "
                "stays listed that long; renewing on the granted TTL",
                ttl_s,
                self.ttl_s,
            )
        self.granted_ttl_s = max(ttl_s, 1)
        if self._fixed_interval is None:
            self.interval_s = _interval(self.granted_ttl_s)

    async def _renew(self) -> None:
        if not self.lease or await self.client.keepalive(self.lease) <= 0:
            if self.lease:
                log.warning("etcd lost this engine's lease %x: registering again", self.lease)
            await self._register()
            return
        if await self._ours_in_store():
            await self._put(force=False)
            self.registered.set()
        else:
            self.registered.clear()

    async def _ours_in_store(self) -> bool:
        """Read the key back (a range read: no revision, no event for routers) and forget the last put when
        the key is gone or overwritten, so that ``_put`` writes it again. Without this, a record deleted
        (``etcdctl del``, a duplicate engine's revoke) or overwritten while our lease lives stayed away for
        good: the lease alone kept renewing, and an engine whose record never changes (vLLM's) never put.
        False when another live lease holds the key: two engines advertise one URL. We then leave it
        alone rather than write over it each renewal: two engines doing that would flip every router's
        view (and its health, incarnation and side channel) between them at each renewal, a storm of
        events, while the last writer winning is stable; when the other's lease ends, its key goes and
        the next renewal restores ours. An unleased value (a hand-made ``etcdctl put``) is overwritten."""
        written = self._written  # a drain's put while we read would make the read look stale
        stored = await self.client.get(self.key)
        if stored is not None and stored[1] not in (0, self.lease):
            if self.foreign_lease != stored[1]:
                log.error(
                    "etcd key %s is held by another engine's lease %x (two engines advertise the same "
                    "URL?): this engine is out of the routers' view until that lease ends; give each "
                    "engine its own --advertise-url",
                    self.key,
                    stored[1],
                )
            self.foreign_lease, self._written = stored[1], None
            return False
        if self.foreign_lease:
            log.info("etcd key %s is free again: writing this engine's record", self.key)
            self.foreign_lease = 0
        lost = stored is None or stored[1] != self.lease or not _same(stored[0], written)
        if written is not None and self._written is written and lost:
            log.warning("this engine's record in etcd was %s: writing it again",
                        "deleted" if stored is None else "overwritten")  # fmt: skip
            self._written = None
            self.restores += 1
        return True

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
                        "etcd call failed (unreachable or refused), serving on and retrying: %s",
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


def _same(value: bytes, written: EngineRecord | None) -> bool:
    """Whether a stored value is the record last put (its ``updated`` stamp aside)."""
    try:
        stored = msgspec.structs.replace(decode_record(value), updated=0.0)
    except ValueError:  # not a record at all: overwritten
        return False
    return stored == written


def _interval(ttl_s: int) -> float:
    # Three renewals per TTL, each given at most the interval, and a failed one tried again within
    # 0.1 s: one lost renewal (refused, or hanging to the client timeout) never lets the lease expire.
    return ttl_s / 3


def _with_draining(rec: EngineRecord) -> EngineRecord:
    return msgspec.structs.replace(rec, draining=True)
