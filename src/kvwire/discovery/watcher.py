"""The router's view of the fleet from etcd: list the prefix, then watch it.

``FleetWatcher.run()`` lists every record under ``{prefix}/engines/``, hands the whole set to
``on_change``, then follows the watch from the next revision, handing the set again after each change.
When etcd goes away the last view stays (the router keeps routing to the engines it knows; their health
checks still run); when it answers again the watcher lists afresh, so records written or expired meanwhile
are seen, then watches again. A value that is not a valid record, or whose key does not match its role
and URL, is skipped and counted (``rejected``): nothing under the prefix can point the router elsewhere
than the key says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

import msgspec

from kvwire.discovery.record import EngineRecord, decode, engine_key, engines_prefix
from kvwire.discovery.source import SourceUnavailable, Store, WatchIdle

log = logging.getLogger(__name__)

# Records under the prefix at most (a fleet of thousands fits; a flood of junk keys does not grow the view).
MAX_ENGINES = 4096


class FleetWatcher:
    def __init__(
        self,
        client: Store,
        on_change: Callable[[Mapping[str, EngineRecord]], None],
        retry_s: float = 0.5,
    ) -> None:
        self.client = client
        self.on_change = on_change
        self.retry_s = retry_s
        self.records: dict[str, EngineRecord] = {}
        self.rejected = 0
        self.resyncs = 0  # full listings after the first (etcd came back, or the watch broke)
        self.synced = asyncio.Event()  # the view follows etcd now (cleared while etcd is away)
        self._stop = asyncio.Event()
        self._listed = False
        self.last_error = ""  # why etcd last failed us ("" once it answers): said in logs and summaries

    @property
    def prefix(self) -> str:
        return engines_prefix(self.client.target.prefix)

    def _accept(self, key: str, raw: bytes) -> EngineRecord | None:
        try:
            rec = decode(raw)
        except ValueError as exc:
            self.rejected += 1
            log.warning("etcd key %s: not an engine record (%s): ignored", key, exc)
            return None
        if engine_key(self.client.target.prefix, rec.role, rec.url) != key:
            self.rejected += 1
            log.warning("etcd key %s: its record names %s %s: ignored", key, rec.role.value, rec.url)
            return None
        return rec

    def _set(self, key: str, raw: bytes | None) -> bool:
        """Apply one key's value; whether the view changed (beyond the record's ``updated`` stamp)."""
        old = self.records.get(key)
        if raw is None:
            self.records.pop(key, None)
            return old is not None
        rec = self._accept(key, raw)
        if rec is None:
            self.records.pop(key, None)
            return old is not None
        if old is None and len(self.records) >= MAX_ENGINES:
            return False
        self.records[key] = rec
        return old is None or msgspec.structs.replace(old, updated=rec.updated) != rec

    async def _list(self) -> int:
        revision, kvs = await self.client.get_prefix(self.prefix)
        self.resyncs += self._listed
        self._listed = True
        self.records = {}
        for key, raw in kvs.items():  # junk keys are skipped, not counted toward the bound
            if len(self.records) >= MAX_ENGINES:
                break
            self._set(key, raw)
        self.on_change(dict(self.records))
        self.synced.set()
        self.last_error = ""
        return revision

    async def _follow(self) -> None:
        revision = await self._list()
        async for event in self.client.watch(self.prefix, revision + 1):
            # on_change re-syncs the router's whole view: only when a record said something new.
            if self._set(event.key, event.value):
                self.on_change(dict(self.records))

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._follow()
            except WatchIdle as exc:
                # Quiet or gone: list again at once. A listing that fails clears synced below.
                log.debug("%s: listing again", exc)
                continue
            except SourceUnavailable as exc:
                if self.synced.is_set():
                    log.warning(
                        "etcd watch lost, keeping the last view of %d engines: %s", len(self.records), exc
                    )
                elif str(exc) != self.last_error:  # never synced, or still away: once per new cause
                    log.warning("etcd at %s does not answer: %s", self.client.target, exc)
                self.last_error = str(exc)
                self.synced.clear()
            except Exception:  # a bug in applying the view must not freeze it for good: log, list again
                log.exception("applying the fleet view failed")
                self.synced.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.retry_s)

    def stop(self) -> None:
        self._stop.set()
