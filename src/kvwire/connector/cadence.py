"""How often the connector's loop ticks: fast right after activity, slow when idle, asleep when nothing
is live. Pure arithmetic over ``now`` (``ConnectorBase._interval`` asks it; the loop thread tells it what
happened), so the policy is one object apart from the threads it paces."""

from __future__ import annotations

from collections.abc import Callable

from kvwire.core.config import ConnectorConfig

_HOT_TICKS = 4  # ticks at the busy rate after any activity (see Cadence.interval)
# The tick interval when nothing is live (no request, transfer or handshake): what an idle engine costs.
# Nothing then waits on a peer's notification: D's push_reg reaches a P that is prefilling that request,
# and P's request_finished wakes the loop, which drains it then; D expects nothing before its engine's
# request_allocated, which wakes the loop too. So the interval only bounds how late the timers run.
DEEP_IDLE_S = 0.5
# ...but only this long after the last activity. P gets D's push_reg while it prefills, and a P deep
# asleep drains it only when its request_finished wakes it, which puts the push_reg's handling (about a
# millisecond) on the request's path; under traffic the loop stays at ``idle_poll_interval_s``.
ACTIVE_GRACE_S = 2.0
# The first poll after a post: NIXL's UCX backend needs a few progress calls to finish a WRITE and send its
# notification (data, then the notification from the status check that sees the data done), so each poll
# interval is paid several times. Polling 50 us after a post, doubling up to ``poll_interval_s``, finishes
# a small write in ~0.2 ms instead of ~1.5 ms at the same number of ticks; a long one soon polls at the
# usual rate.
FIRST_BUSY_POLL_S = 0.00005
_RAMP_TICKS = 4  # 50, 100, 200, 400 us: the ticks before the busy rate after activity


class Cadence:
    """The tick interval after each tick, from the activity the connector reports (``activity``: an
    engine call, a notification out, a post, a transfer's end; ``heard``: a notification in, which counts
    only for the idle grace)."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self.quiet = 0  # ticks since the last activity
        self.active_at = -ACTIVE_GRACE_S  # when the last activity was seen
        # A notification went out (a send, or a WRITE's attached one at its end) since the last tick: with
        # the progress thread off it may wait in UCX for the next progress call, so one tick follows soon.
        self.flush = False

    def activity(self, flush: bool = False) -> None:
        self.quiet = 0
        self.flush = self.flush or flush

    def heard(self, now: float) -> None:
        self.active_at = now

    def in_grace(self, now: float) -> bool:
        """Activity was seen less than ``ACTIVE_GRACE_S`` ago (the connector is not idle yet)."""
        return now - self.active_at < ACTIVE_GRACE_S

    def interval(self, now: float, busy: bool, awaiting: bool, wake_at: Callable[[], float]) -> float:
        """While something is awaited (``awaiting``: a transfer posted, a handshake running, a live
        request), after any activity: from ``FIRST_BUSY_POLL_S`` doubling to ``poll_interval_s``, which
        holds while transfers are live (``busy``) and for ``_HOT_TICKS`` more ticks, then doubling back to
        the idle interval. A peer's answer usually follows soon after activity, and NIXL has no descriptor
        to wait on: this catches it without polling fast all the time.

        With nothing awaited, no ramp: one tick at ``FIRST_BUSY_POLL_S`` if a notification went out since
        the last tick (its progress call sends what UCX still holds), else the idle interval, or out of the
        grace ``DEEP_IDLE_S``, woken early for the core's next timer (``wake_at()``). A request's last step
        (P's write ending, D's READY) is activity, but nothing it awaits can follow, and the next engine call
        wakes the loop at once: the ramp's ticks there only woke a sleeping thread to find nothing
        (measured here: a NIXL ``getNotifs`` costs 0.6 us in a loop and 25 us as the first call after a
        1 ms sleep, so each tick's cost is mostly its wake-up)."""
        cfg = self.config
        if self.quiet == 0:
            self.active_at = now  # something happened since the last tick
        self.quiet += 1
        flush, self.flush = self.flush, False  # sent in (or since) the tick that just ran: the next sends it
        backoff = cfg.poll_interval_s * (1 << min(max(self.quiet - _HOT_TICKS - _RAMP_TICKS, 0), 16))
        if not awaiting:
            if flush:
                return FIRST_BUSY_POLL_S
            if self.in_grace(now):
                return cfg.idle_poll_interval_s
            cap = max(cfg.idle_poll_interval_s, DEEP_IDLE_S)
            return max(0.0, min(cap, max(backoff, cfg.idle_poll_interval_s), wake_at() - now))
        ramp = FIRST_BUSY_POLL_S * (1 << min(self.quiet - 1, 16))
        if busy or ramp < cfg.poll_interval_s:
            return min(cfg.poll_interval_s, ramp)
        if self.quiet <= _HOT_TICKS + _RAMP_TICKS:
            return cfg.poll_interval_s
        return min(cfg.idle_poll_interval_s, backoff)
