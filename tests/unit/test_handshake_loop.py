"""BackgroundLoop: a thread-owned event loop for synchronous engine threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvwire.errors import HandshakeError
from kvwire.handshake.loop import BackgroundLoop


async def _where() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_submit_runs_on_the_loop_thread() -> None:
    with BackgroundLoop(name="bg-test") as bg:
        assert bg.submit(_where()).result(5) == "bg-test"
        assert bg.run(_where(), 5) == "bg-test"


def test_close_cancels_pending_work_and_refuses_more() -> None:
    bg = BackgroundLoop()
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    fut = bg.submit(forever())
    assert started.wait(5)
    bg.close()
    assert fut.cancelled()
    coro = _where()
    with pytest.raises(HandshakeError):
        bg.submit(coro)
    bg.close()  # idempotent
    assert bg.loop.is_closed()


def test_exceptions_reach_the_caller() -> None:
    async def boom() -> None:
        raise HandshakeError("boom")

    with BackgroundLoop() as bg, pytest.raises(HandshakeError, match="boom"):
        bg.run(boom(), 5)
