"""``CircuitBreaker``: the per-address breaker of ``kvwire.core.breaker`` with a clock, for callers outside
the handshake core (tests, tools). The rules, and why there is a breaker, are in ``kvwire.core.breaker``;
a ``HandshakeManager`` hands it its own clock's ``now`` (the one injected clock), not this one's."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvwire.core.breaker import DEFAULT_BASE_S, DEFAULT_MAX_ENTRIES, DEFAULT_MAX_S, Breaker

__all__ = ["DEFAULT_BASE_S", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_S", "CircuitBreaker"]


class CircuitBreaker(Breaker):
    """Open circuits by address (host, port); not thread-safe (one event loop uses it)."""

    def __init__(
        self,
        *,
        base_s: float = DEFAULT_BASE_S,
        max_s: float = DEFAULT_MAX_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(base_s=base_s, max_s=max_s, max_entries=max_entries)
        self._clock = clock

    def check(self, host: str, port: int, incarnation: str | None = None) -> None:
        self.check_at(self._clock(), host, port, incarnation)

    def failed(self, host: str, port: int, incarnation: str | None = None) -> float:
        return self.failed_at(self._clock(), host, port, incarnation)

    def is_open(self, host: str, port: int) -> bool:
        return self.is_open_at(self._clock(), host, port)
