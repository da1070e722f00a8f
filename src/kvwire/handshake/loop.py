"""A background asyncio loop in its own thread, for engines whose own threads are synchronous.

The connector starts one per process: handshake coroutines (and the side-channel server) run there, and
engine threads get ``concurrent.futures.Future`` results from :meth:`BackgroundLoop.submit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvwire.errors import HandshakeError

T = TypeVar("T")

_STOP_TIMEOUT_S = 5.0


class BackgroundLoop:
    """Owns an event loop running in a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "kvwire-handshake") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait(_STOP_TIMEOUT_S)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; thread-safe."""
        if self._closed:
            coro.close()
            raise HandshakeError("the background loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Submit and wait (from a thread other than the loop's)."""
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        """Cancel what is still running, stop the loop and join the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                fut.result(_STOP_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    async def _cancel_all(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._loop.shutdown_asyncgens()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
