"""A stop signal before uvicorn takes the signals over (its start-up) must still stop the server."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvwire.startup import record_stops


@dataclass
class _Server:
    started: bool = False
    should_exit: bool = False


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("restore_handlers")
def test_a_signal_during_start_up_stops_the_server_once_started() -> None:
    """SIGTERM after the engine's handlers were installed and before uvicorn's was recorded and nothing
    else: the engine registered and served until a second signal (a supervisor's SIGKILL)."""
    server = _Server()
    stopped_by = record_stops(server)
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    handler(signal.SIGTERM, None)
    assert server.should_exit and stopped_by == [signal.SIGTERM]
    # Once uvicorn serves, it handles signals itself and re-raises them here after its graceful shutdown:
    # recorded only (the exit status 0 of a requested stop).
    later = _Server(started=True)
    stopped_later = record_stops(later)
    sigint = signal.getsignal(signal.SIGINT)
    assert callable(sigint)
    sigint(signal.SIGINT, None)
    assert not later.should_exit and stopped_later == [signal.SIGINT]
