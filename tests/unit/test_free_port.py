"""``free_port``: the ports a test harness hands out before its servers bind them."""

from __future__ import annotations

import socket

from kvwire.testing.procs import free_port


def test_picks_before_any_bind_never_repeat() -> None:
    """Two picks before either server binds must differ: a CI chaos run drew one port for D's HTTP
    listener and its side channel (300 picks from the 12,000-port range repeat one 97 % of the time)."""
    picks = [free_port() for _ in range(300)]
    assert len(set(picks)) == len(picks)
    for port in picks[:5]:  # and each was free when picked
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
