"""A clock a test moves by hand, to inject where kvwire takes ``clock`` (the connector, a handshake
manager, the reporter): timers (leases, fences, reaping, breaker windows) then fire when the test says
so, not after a real-time sleep. Safe to read from the connector's loop thread while a test advances it."""

from __future__ import annotations

import threading


class VirtualClock:
    """``clock()`` is ``now``; ``advance(seconds)`` moves it on (never back)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += seconds
            return self._now
