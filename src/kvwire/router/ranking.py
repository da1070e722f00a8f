"""Engines of one role kept in pick order as their load changes, so a pick costs the same at 2 engines as
at 64 (``kvwire bench fleet``'s ``router_cost``).

A ``Ranking`` is a lazy min-heap: every change of an engine's key (a request sent or ended, a health
report, prompt tokens queued) pushes its new key; an entry whose engine has a newer one, or left, is
dropped when it reaches the top. A pick is a peek: O(1), plus O(log n) per change. The heap is rebuilt
when dead entries outnumber live ones 3:1, so it stays O(engines) in memory. Equal keys go to the entry
pushed first: the engine whose load changed longest ago, which rotates equal engines as the pickers'
rotation does (``policy.least_loaded``).

The entry at the top is checked against the engine's key as computed now, and pushed again if it moved,
and against ``keep`` (the engine may still be picked): an update missed by a caller costs a worse pick,
never a pick of an engine that left or went down.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


T = TypeVar("T", bound=_HasUrl)
Key = tuple[int, ...]


class Ranking(Generic[T]):
    def __init__(self, key: Callable[[T], Key], keep: Callable[[T], bool] = lambda _: True) -> None:
        self._key = key
        self._keep = keep
        self._heap: list[tuple[Key, int, T]] = []
        self._live: dict[str, tuple[Key, int]] = {}  # url -> (key, seq) of its live entry
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, url: str) -> bool:
        return url in self._live

    def update(self, item: T) -> None:
        """The item's key may have changed (or it joins)."""
        key = self._key(item)
        live = self._live.get(item.url)
        if live is not None and live[0] == key:
            return
        self._seq += 1
        self._live[item.url] = (key, self._seq)
        heapq.heappush(self._heap, (key, self._seq, item))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._rebuild()

    def remove(self, url: str) -> None:
        self._live.pop(url, None)

    def best(self) -> T | None:
        """The item with the lowest key (the earliest pushed among equals), or None when empty."""
        heap = self._heap
        while heap:
            key, seq, item = heap[0]
            live = self._live.get(item.url)
            if live is None or live[1] != seq or live[0] != key:
                heapq.heappop(heap)  # a dead entry: the item left, or has a newer one
                continue
            if not self._keep(item):
                heapq.heappop(heap)
                del self._live[item.url]
                continue
            if self._key(item) == key:
                return item
            heapq.heappop(heap)  # the key moved without an update: push it where it belongs now
            self._live.pop(item.url)
            self.update(item)
        return None

    def _rebuild(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2].url) == (e[0], e[1])]
        heapq.heapify(self._heap)
