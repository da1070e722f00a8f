"""A connector says when its own loop ran late, and whether its thread was starved of CPU or blocked
(``kvwire.connector.lag``): in the pipeline-parallel engine test D's loop thread went unscheduled for up to
30 s and only the peers' timeouts told of it. A real connector's late tick: ``test_connector_idle.py``."""

from __future__ import annotations

import logging

import pytest

from kvwire.connector.lag import LoopLag
from kvwire.testing.clock import VirtualClock

LOG = logging.getLogger("kvwire.connector")


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event loop ran" in r.getMessage()]


def stalled(waits: list[float | None], late_by: float, caplog: pytest.LogCaptureFixture) -> LoopLag:
    """One on-time tick (which samples the run-queue wait), then one ``late_by`` past its due time."""
    clock, it = VirtualClock(100.0), iter(waits)
    lag = LoopLag("consumer", clock, read_wait=lambda: next(it))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        lag.due(100.0)
        lag.ran(100.0, LOG)
        lag.due(100.5)
        lag.ran(clock.advance(0.5 + late_by), LOG)
    return lag


def test_a_late_tick_whose_thread_waited_for_a_cpu_says_the_process_is_starved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lag = stalled([1.0, 3.3], 2.5, caplog)  # waited 2.3 s of the 3.0 s since the sample
    (line,) = lines(caplog)
    assert lag.stalls == 1
    assert line.startswith("consumer: this connector's event loop ran 2.5 s late"), line
    assert "waited 2.3 s of the last 3.0 s for a CPU: this process is starved of CPU" in line, line
    assert "VLLM_CPU_OMP_THREADS_BIND" in line


def test_a_late_tick_whose_thread_was_not_waiting_for_a_cpu_says_it_was_blocked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stalled([1.0, 1.1], 2.5, caplog)
    (line,) = lines(caplog)
    assert "waited only 0.1 s of the last 3.0 s for a CPU, so it was blocked, not starved" in line, line
    assert "GIL" in line


def test_without_a_run_queue_figure_the_line_says_only_that_the_loop_ran_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stalled([None, None], 1.0, caplog)
    (line,) = lines(caplog)
    assert line.endswith("while peers' deadlines ran on"), line


def test_a_tick_within_the_bound_is_no_stall(caplog: pytest.LogCaptureFixture) -> None:
    lag = stalled([1.0, 1.4], 0.5, caplog)  # exactly warn_s late: not a stall
    assert lag.stalls == 0 and lines(caplog) == []


def test_stalls_are_counted_each_time_and_logged_once_per_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock(100.0)
    lag = LoopLag("producer", clock, read_wait=lambda: None)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for start in (100.0, 103.0, 111.0):  # the second stall comes 3 s after the first
            lag.due(start)
            lag.ran(clock.advance(start + 1.0 - clock.now), LOG)
    assert lag.stalls == 3
    first, third = lines(caplog)
    assert "(and" not in first
    assert third.endswith("(and 1 more like it not logged)"), third
