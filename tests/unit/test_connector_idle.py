"""The connector's ticker when idle: it backs off to ``DEEP_IDLE_S`` only when nothing is live, and an
engine call wakes it at once. Structural checks (intervals chosen, timers cancelled), no timing bounds."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwire.connector import ConsumerEventKind, ProducerOutcome
from kvwire.connector._base import ConnectorBase
from kvwire.connector.cadence import DEEP_IDLE_S, FIRST_BUSY_POLL_S
from kvwire.connector.timeline import Stage
from kvwire.kv.spec import KVSpec
from kvwire.testing.connector_env import Pair
from kvwire.testing.engines import wait_for

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(SPEC)
    try:
        yield p
    finally:
        p.consumer.close()
        p.producer.close()
        p.loop.close()


def record_intervals(conn: ConnectorBase[Any]) -> list[float]:
    """Every interval the ticker picks from now on (appended on the loop thread)."""
    picked: list[float] = []
    pick = conn._interval

    def recording(now: float) -> float:
        picked.append(pick(now))
        return picked[-1]

    conn._interval = recording  # type: ignore[method-assign]
    return picked


def record_intervals_after(
    conn: ConnectorBase[Any], transfer_id: str, stage: Stage
) -> list[tuple[bool, float]]:
    """Every interval the ticker picks from now on, each with whether ``transfer_id`` had passed ``stage``
    in the connector's timeline when it was picked (appended on the loop thread)."""
    picked: list[tuple[bool, float]] = []
    pick = conn._interval

    def recording(now: float) -> float:
        picked.append((stage in conn.timeline.get(transfer_id), pick(now)))
        return picked[-1][1]

    conn._interval = recording  # type: ignore[method-assign]
    return picked


def test_an_idle_ticker_backs_off_to_the_deep_idle_interval(pair: Pair) -> None:
    picked = record_intervals(pair.producer)
    cap = max(pair.p_config.idle_poll_interval_s, DEEP_IDLE_S)
    wait_for(lambda: cap in picked, "the deep idle interval")
    assert max(picked) <= cap
    assert picked[0] < pair.p_config.idle_poll_interval_s * 2  # it got there by backing off


def test_a_request_waiting_on_its_peer_keeps_the_idle_poll_interval(pair: Pair) -> None:
    picked = record_intervals(pair.consumer)
    pair.consumer.request_allocated("t-live", [0, 1], 32, 0, pair.remote())
    wait_for(lambda: len(picked) >= 30, "30 ticks of a live request")
    # D waits for P's done: it must keep polling at the idle rate, never the deep one.
    assert max(picked[-20:]) <= pair.d_config.idle_poll_interval_s
    pair.consumer.abort("t-live")


def _deep_timer(conn: ConnectorBase[Any], loop: asyncio.AbstractEventLoop) -> asyncio.Handle | None:
    """The ticker's pending timer if it is a deep idle one with most of its interval still to go."""
    nxt = conn._next
    if isinstance(nxt, asyncio.TimerHandle) and nxt.when() - loop.time() > DEEP_IDLE_S / 2:
        return nxt
    return None


def _longer(picked: list[float], count: int) -> Callable[[], bool]:
    return lambda: len(picked) > count


def test_an_engine_call_wakes_a_deep_idle_ticker_at_once(pair: Pair) -> None:
    conn = pair.producer
    loop = pair.loop.loop
    picked = record_intervals(conn)
    for attempt in range(20):
        timer = wait_for(lambda: pair.on_loop(lambda: _deep_timer(conn, loop)), "a deep idle timer")
        count = len(picked)
        conn.abort(f"unknown-{attempt}")  # any engine call; the core refuses this one
        wait_for(_longer(picked, count), "the next tick")
        if timer.cancelled():
            # Woken: the deep timer was replaced. The call was refused and left nothing awaited, so the
            # ticker rests at the idle rate (it ramps only while something is awaited).
            assert picked[count] <= pair.p_config.idle_poll_interval_s
            return
        # The timer fired before the call reached the loop (a starved test machine): try again.
    raise AssertionError("the deep idle timer was never cancelled by an engine call")


def test_a_push_reg_for_a_request_still_prefilling_does_not_start_fast_polls(pair: Pair) -> None:
    """P can do nothing with D's registration until its engine finishes the request (that call wakes the
    loop): ticking at 50-400 us meanwhile only took the GIL from the prefill."""
    conn = pair.producer
    # A first registration makes P load D (its handshake's answer wakes the loop, rightly): not measured.
    pair.consumer.request_allocated("t-warm", [2, 3], 32, 0, pair.remote())
    wait_for(lambda: Stage.PUSH_REG_RECEIVED in conn.timeline.get("t-warm"), "the first push_reg")
    wait_for(lambda: pair.on_loop(lambda: not conn._tasks), "P's handshake with D")
    picked = record_intervals_after(conn, "t-prefilling", Stage.PUSH_REG_RECEIVED)
    pair.consumer.request_allocated("t-prefilling", [0, 1], 32, 0, pair.remote())
    wait_for(lambda: sum(arrived for arrived, _ in picked) >= 6, "six ticks after the push_reg")
    after = [interval for arrived, interval in picked if arrived]
    # A ramp another event started may still be ending; the arrival must not start one (at 50 us).
    assert FIRST_BUSY_POLL_S not in after, after
    pair.consumer.abort("t-prefilling")
    pair.consumer.abort("t-warm")


def test_a_finished_request_starts_no_fast_polls(pair: Pair) -> None:
    """A request's last step is activity, but nothing can answer it: with nothing awaited the ticker rests
    at the idle rate (each tick's cost is mostly its wake-up), and the next engine call wakes it at once."""
    blocks = [0, 1]
    pair.fill_p(blocks, 32)
    # P's done taken: D's request READY in the same tick.
    picked = record_intervals_after(pair.consumer, "t-done", Stage.DONE_RECEIVED)
    pair.consumer.request_allocated("t-done", blocks, 32, 0, pair.remote())
    pair.producer.request_finished("t-done", blocks, 32)
    assert [e.kind for e in pair.d_event("t-done")] == [ConsumerEventKind.READY]
    wait_for(lambda: sum(ready for ready, _ in picked) >= 4, "four ticks after READY")
    before = [interval for ready, interval in picked if not ready]
    after = [interval for ready, interval in picked if ready]
    assert FIRST_BUSY_POLL_S in before, before  # while it waited for P's done, it ramped
    assert min(after) == pair.d_config.idle_poll_interval_s, after


def test_a_notification_out_gets_one_flush_tick_when_nothing_else_is_awaited(pair: Pair) -> None:
    """With NIXL's progress thread off a notification may wait in UCX until the next progress call: after
    P's write ends (its done attached, handed to UCX by that status check) one tick follows at once,
    then, nothing being awaited, the idle rate."""
    blocks = [0, 1]
    pair.fill_p(blocks, 32)
    picked = record_intervals_after(pair.producer, "t-flush", Stage.WRITE_DONE)
    pair.consumer.request_allocated("t-flush", blocks, 32, 0, pair.remote())
    pair.producer.request_finished("t-flush", blocks, 32)
    assert pair.p_event("t-flush").outcome is ProducerOutcome.SENT
    wait_for(lambda: sum(written for written, _ in picked) >= 4, "four ticks after the write ended")
    after = [interval for written, interval in picked if written]
    assert after[0] == FIRST_BUSY_POLL_S, after
    assert set(after[1:4]) == {pair.p_config.idle_poll_interval_s}, after


def test_a_write_is_marked_done_when_its_end_is_seen_not_when_the_tick_began(pair: Pair) -> None:
    """The timeline's ``write_done`` is the time the status check saw the write end. A tick that drains a
    push_reg, posts the write and sees it end (the in-process backend ends a write at once) took its
    ``now`` before the post: marking with it put ``write_done`` before ``write_posted``. P's clock here
    steps 1 ms a call, so every step of a tick reads a later time than the one before it."""
    base, calls = time.monotonic(), itertools.count()
    pair.producer._clock = lambda: base + 0.001 * next(calls)
    blocks = [0, 1]
    pair.fill_p(blocks, 32)
    for i in range(3):
        tid = f"t-mark-{i}"
        pair.consumer.request_allocated(tid, blocks, 32, 0, pair.remote())
        pair.producer.request_finished(tid, blocks, 32)
        assert pair.p_event(tid).outcome is ProducerOutcome.SENT
        assert pair.d_event(tid)[-1].kind is ConsumerEventKind.READY
        marks = pair.producer.timeline.get(tid)
        assert marks[Stage.WRITE_POSTED] < marks[Stage.WRITE_DONE], marks


def test_a_connector_whose_loop_runs_late_logs_it(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """P's clock jumps 2 s between two ticks, as if its thread had not run for that long: the next tick
    is counted and logged as a stall of about 2 s."""
    offset = 0.0
    pair.producer._clock = lambda: time.monotonic() + offset
    with caplog.at_level(logging.WARNING, logger="kvwire.connector"):
        offset = 2.0
        wait_for(lambda: pair.producer.lag.stalls >= 1, "a late tick", timeout_s=5.0)
    mine = [m for r in caplog.records if (m := r.getMessage()).startswith("producer: this connector's event")]
    assert len(mine) == 1, caplog.text
    late = float(re.search(r"ran (\d+\.\d) s late", mine[0]).group(1))  # type: ignore[union-attr]
    # The jump, less the part of an interval the loop was still due to wait (at most 1 s), plus how late
    # the loop thread itself woke on a busy host.
    assert 1.0 <= late <= 3.0, mine[0]
