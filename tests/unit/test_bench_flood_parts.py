"""``kvwire bench flood``'s pure parts: P's counters from /metrics, RSS from /proc, the listener's count, the
modes flag. The flood itself, against real processes: ``tests/integration/test_bench_flood.py``."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from kvwire_tools.bench.common import counter_deltas
from kvwire_tools.bench.flood import Sample, _modes, phase_figures
from kvwire_tools.bench.flood_rogue import Listener, dropped_by_reason, failures_by_reason, hwm_mb, rss_mb

METRICS = """\
# HELP kvwire_dropped_notifications_total Peer notifications dropped
# TYPE kvwire_dropped_notifications_total counter
kvwire_dropped_notifications_total{role="prefill",model="m",reason="overload"} 10.0
kvwire_dropped_notifications_total{role="prefill",model="m",reason="heartbeat_unknown_ids"} 5.0
kvwire_dropped_notifications_total{role="prefill",model="other",reason="overload"} 2.0
# HELP kvwire_failures_total Transfer failures, by reason
# TYPE kvwire_failures_total counter
kvwire_failures_total{role="prefill",model="m",reason="fence_expired"} 3.0
"""


def test_counters_are_summed_per_reason_and_differences_keep_what_moved() -> None:
    assert dropped_by_reason(METRICS) == {"overload": 12.0, "heartbeat_unknown_ids": 5.0}
    assert failures_by_reason(METRICS) == {"fence_expired": 3.0}
    before = {"overload": 2.0, "heartbeat_unknown_ids": 5.0}
    assert counter_deltas(before, dropped_by_reason(METRICS)) == {"overload": 10}


def test_rss_of_this_process() -> None:
    now, peak = rss_mb(os.getpid()), hwm_mb(os.getpid())
    assert 1.0 < now <= peak


def test_phase_figures_count_failed_and_wrong_apart() -> None:
    samples = [Sample(0.01, True, True), Sample(0.02, True, False), Sample(5.0, False, False, "HTTP 503")]
    fig = phase_figures(samples)
    assert (fig["requests"], fig["failed"], fig["wrong"]) == (3, 1, 1)
    assert fig["errors"] == {"HTTP 503": 1}
    assert fig["p50_ms"] == pytest.approx(20.0) and fig["p99_ms"] == pytest.approx(5000.0)
    assert phase_figures([])["p50_ms"] is None


def test_listener_counts_connections() -> None:
    listener = Listener()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", listener.port), timeout=2.0) as conn:
                conn.recv(1)  # closed by the listener: b""
    finally:
        listener.close()
    assert listener.connections == 3


def test_modes_flag() -> None:
    assert _modes("open,secret") == ["open", "secret"]
    assert _modes("secret") == ["secret"]
    with pytest.raises(argparse.ArgumentTypeError):
        _modes("open,bogus")
