"""CallWorker: agent calls that may wait on the network run in a worker thread, bounded; a stuck one is
abandoned, counted, undone if it ever succeeds, and makes other calls fail fast instead of waiting."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvwire.errors import AgentBusy, AgentStalled, TransportError
from kvwire.transport.offload import CallWorker


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


def _after(event: threading.Event, result: str) -> str:
    """A call that returns ``result`` once ``event`` is set (a load stuck until the network heals)."""
    event.wait(30)
    return result


def _wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def test_a_call_returns_its_result_or_raises_its_error_from_another_thread() -> None:
    async def body() -> None:
        w = CallWorker("a")
        loop_thread = threading.get_ident()
        assert await w.call(lambda: threading.get_ident() != loop_thread, 1.0, "where") is True

        def boom() -> None:
            raise TransportError("nope")

        with pytest.raises(TransportError, match="nope"):
            await w.call(boom, 1.0, "boom")
        assert w.stuck_calls == 0 and w.stalled_s() == 0.0
        w.close()

    run(body)


def _free_for_another_thread(w: CallWorker) -> bool:
    got: list[bool] = []

    def take() -> None:
        got.append(w.lock.acquire(blocking=False))
        if got[0]:
            w.lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(5.0)
    return got == [True]


def test_a_stuck_call_is_abandoned_counted_refuses_others_and_is_undone_when_it_returns() -> None:
    async def body() -> None:
        w = CallWorker("a", grace_s=0.05)
        release = threading.Event()
        undone: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(AgentStalled, match="did not return within"):
            await w.call(lambda: _after(release, "loaded"), 0.2, "add_remote_agent", undo=undone.append)
        assert 0.15 <= time.monotonic() - t0 < 1.0
        assert w.stuck_calls == 1 and w.stalled_s() >= 0.15
        with pytest.raises(AgentBusy, match="refused"):  # at once, not queued behind the stuck call
            await w.call(lambda: "second", 5.0, "add_remote_agent")
        t1 = time.monotonic()
        with pytest.raises(AgentBusy), w.hold("send_notif"):
            pass
        with pytest.raises(AgentBusy, match="progress refused"):  # the tick's call, refused the same way
            w.held_call("progress", lambda: "notifs")
        assert time.monotonic() - t1 < 0.05  # the grace is counted from the stuck call's start
        order: list[str] = []
        assert w.run_or_defer(lambda: order.append("deferred"), "remove") is False
        release.set()
        _wait_until(lambda: w.stalled_s() == 0.0 and order == ["deferred"])
        assert undone == ["loaded"]  # its success reverted, in the worker, before the deferred removal
        assert await w.call(lambda: "again", 1.0, "add_remote_agent") == "again"
        with w.hold("send_notif"):
            pass
        assert w.held_call("progress", lambda x: x + 1, 41) == 42
        assert _free_for_another_thread(w)  # released after the call
        w.close()

    run(body)


def test_an_abandoned_call_that_fails_is_not_undone() -> None:
    async def body() -> None:
        w = CallWorker("a")
        release = threading.Event()
        undone: list[object] = []

        def fails() -> str:
            release.wait(30)
            raise TransportError("connect failed")

        with pytest.raises(AgentStalled):
            await w.call(fails, 0.05, "add_remote_agent", undo=undone.append)
        release.set()
        _wait_until(lambda: w.stalled_s() == 0.0)
        assert undone == []
        w.close()

    run(body)


def test_a_short_call_is_waited_for_by_other_callers() -> None:
    """A normal load (milliseconds) holds the lock briefly: callers wait for it rather than fail."""

    async def body() -> None:
        w = CallWorker("a", grace_s=1.0)
        started = threading.Event()

        def short() -> str:
            started.set()
            time.sleep(0.1)
            return "ok"

        task = asyncio.ensure_future(w.call(short, 5.0, "add_remote_agent"))
        await asyncio.to_thread(started.wait, 5)
        with w.hold("progress"):
            assert not task.done() or task.result() == "ok"
        assert await task == "ok"
        w.close()

    run(body)


def test_cancelling_the_caller_abandons_the_call_without_counting_it_stuck() -> None:
    async def body() -> None:
        w = CallWorker("a")
        release = threading.Event()
        undone: list[str] = []
        task = asyncio.ensure_future(
            w.call(lambda: _after(release, "late"), 30.0, "add_remote_agent", undo=undone.append)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.stuck_calls == 0
        release.set()
        _wait_until(lambda: undone == ["late"])
        w.close()

    run(body)
