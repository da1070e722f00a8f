"""A circuit breaker per peer address, as pure rules over the ``now`` it is given (the handshake core's).

After a handshake with an address fails on the network, further handshakes with it fail at once for a
backoff window instead of each waiting out its own deadline.

Why. A request names its peer's address (``kv_transfer_params``), so one dead or blackholed address can be
named by every request of a burst. Without a breaker each of them spends a whole ``handshake_timeout_s``
(and a side-channel connection, a load) on it; with one, the first pays and the rest fail fast with
``CircuitOpen`` until the window passes. The next handshake after the window is a probe: success closes the
circuit, another failure opens it again for twice as long (up to ``max_s``).

Only network failures trip it (timeouts, an unreachable side channel, a load the transport refused): a peer
that answers and refuses (incompatible, unauthorized, no such rank) answers fast anyway. The table is
bounded (``max_entries``, least recently failed evicted first), so naming many addresses cannot grow it.

A trip remembers the peer engine, when the caller named it: a sign of life from that engine (an
authenticated notification after a silence, ``heard``) closes the circuit at once, so a peer that is back
after a partition is not refused for the rest of the window.

A trip remembers the peer incarnation the failed handshake was after, when it was known. A caller that
names another incarnation (the peer restarted on the same address, or another engine took it) is not
held by it: its handshake goes ahead, and a failure of it opens a fresh window for the new life.

It reads no clock: every call is handed ``now`` (``kvwire.handshake.breaker.CircuitBreaker`` adds one for
callers outside a core).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kvwire.errors import CircuitOpen

DEFAULT_BASE_S = 1.0
DEFAULT_MAX_S = 30.0
DEFAULT_MAX_ENTRIES = 1024


@dataclass
class _Trip:
    failures: int
    until: float
    incarnation: str | None = None  # the life the failed handshakes were after, when known
    engine: str | None = None  # the engine the failed handshakes were after, when known


class Breaker:
    """Open circuits by address (host, port), in the time the caller hands in; not thread-safe."""

    def __init__(
        self,
        *,
        base_s: float = DEFAULT_BASE_S,
        max_s: float = DEFAULT_MAX_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.base_s, self.max_s, self.max_entries = base_s, max_s, max_entries
        self._trips: collections.OrderedDict[tuple[str, int], _Trip] = collections.OrderedDict()
        self.opened = 0  # times a circuit opened (a first failure, or a failed probe)
        self.fast_failures = 0  # handshakes refused at once while a circuit was open
        self.evicted = 0  # entries dropped to keep the table bounded
        self.closed_by_word = 0  # circuits closed early by a sign of life from their engine

    def check_at(self, now: float, host: str, port: int, incarnation: str | None = None) -> None:
        """Raise ``CircuitOpen`` while ``host:port``'s window lasts; else return (a probe, if it had one).
        A caller after a known ``incarnation`` other than the one that tripped it is let through."""
        trip = self._trips.get((host, port))
        if trip is None or _another_life(trip, incarnation):
            return
        left = trip.until - now
        if left > 0:
            self.fast_failures += 1
            raise CircuitOpen(
                f"{host}:{port}: {trip.failures} handshake(s) in a row failed on the network; "
                f"not tried again for {left:.1f} s"
            )

    def failed_at(
        self, now: float, host: str, port: int, incarnation: str | None = None, engine: str | None = None
    ) -> float:
        """A handshake with ``host:port`` (after ``incarnation``, when known) failed on the network: open
        (or reopen) its circuit; the window. Another life's failures do not lengthen it."""
        key = (host, port)
        trip = self._trips.pop(key, None)
        failures = 1 if trip is None or _another_life(trip, incarnation) else trip.failures + 1
        window = min(self.base_s * float(1 << min(failures - 1, 30)), self.max_s)
        kept = incarnation if incarnation is not None or trip is None else trip.incarnation
        engine = engine if engine is not None or trip is None else trip.engine
        self._trips[key] = _Trip(failures, now + window, kept, engine)
        self.opened += 1
        while len(self._trips) > self.max_entries:
            self._trips.popitem(last=False)
            self.evicted += 1
        return window

    def succeeded(self, host: str, port: int) -> None:
        self._trips.pop((host, port), None)

    def heard(self, engine: str) -> int:
        """``engine`` spoke (an authenticated notification after a silence): close its circuits; how many."""
        if not self._trips:
            return 0
        closed = [key for key, trip in self._trips.items() if trip.engine == engine]
        for key in closed:
            del self._trips[key]
        self.closed_by_word += len(closed)
        return len(closed)

    def is_open_at(self, now: float, host: str, port: int) -> bool:
        trip = self._trips.get((host, port))
        return trip is not None and trip.until > now

    def __len__(self) -> int:
        return len(self._trips)


def _another_life(trip: _Trip, incarnation: str | None) -> bool:
    return None not in (trip.incarnation, incarnation) and trip.incarnation != incarnation
