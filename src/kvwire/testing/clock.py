"""A clock a test moves by hand, to inject where kvwire takes ``clock`` (the connector, a handshake
manager, the reporter): timers (leases, fences, reaping, breaker windows) then fire when the test says
so, not after a real-time sleep. Safe to read from the connector's loop thread while a test advances it.
Where a timer runs in real time on an event loop (a registrar's renewals), ``until`` waits for what it
should cause, not for a fixed time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


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


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> float:
    """Wait (polling every 10 ms on the running loop) until ``cond()``; the seconds it took.
    ``AssertionError`` naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not cond():
        if loop.time() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)
    return loop.time() - start
