"""Ticks that ran late, and why: a connector whose loop thread does not run cannot answer its side
channel, progress NIXL or send heartbeats, and its peers' deadlines run on meanwhile. When that happened in
the pipeline-parallel engine test (D's loop thread pinned to a core where a P stage's worker busy-waited),
the only trace was the peers' timeouts; this module makes the starved side say so itself.

``LoopLag`` is told when the next tick is due (``due``) and when a tick ran (``ran``). A tick more than
``warn_s`` late is a stall, logged at most once per 10 s (``Throttle``). On Linux the line also
says whether the thread was waiting for a CPU (its run-queue wait in ``/proc/thread-self/schedstat``,
sampled about once a second) or was not runnable (the loop or the GIL held by someone else), which call
for different fixes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvwire.logsetup import Throttle

WARN_S = 0.5  # a tick this late is a stall (peers' deadlines are seconds; the tick cadence is ms)
_SAMPLE_EVERY_S = 1.0  # how often the run-queue wait is read on on-time ticks: one small file read


def runqueue_wait_s() -> float | None:
    """This thread's total time spent runnable but not running, in seconds (None where unknown)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopLag:
    """Notices late ticks of one connector loop and logs why (module doc)."""

    def __init__(
        self,
        role: str,
        clock: Callable[[], float],
        warn_s: float = WARN_S,
        read_wait: Callable[[], float | None] = runqueue_wait_s,
    ) -> None:
        self.role = role
        self.warn_s = warn_s
        self.stalls = 0  # ticks that ran more than warn_s late, since creation
        self._read_wait = read_wait
        self._due = clock()
        self._sampled_at = -_SAMPLE_EVERY_S
        self._wait_then: float | None = None
        self._log = Throttle(clock=clock)

    def due(self, at: float) -> None:
        """The next tick is scheduled for ``at``."""
        self._due = at

    def ran(self, now: float, logger: logging.Logger) -> None:
        """A tick runs at ``now``: a stall is counted and (throttled) logged."""
        late = now - self._due
        if late <= self.warn_s:
            if now - self._sampled_at >= _SAMPLE_EVERY_S:
                self._sampled_at, self._wait_then = now, self._read_wait()
            return
        self.stalls += 1
        wait_now = self._read_wait()
        self._log.log(logger, logging.WARNING, "%s", self._explain(now, late, wait_now))
        self._sampled_at, self._wait_then = now, wait_now  # the next stall is measured from here

    def _explain(self, now: float, late: float, wait_now: float | None) -> str:
        head = (
            f"{self.role}: this connector's event loop ran {late:.1f} s late; meanwhile it answered no side "
            "channel, progressed no transfer and sent no heartbeat, while peers' deadlines ran on"
        )
        if not wait_now or self._wait_then is None:  # None, or 0: a kernel that does not count it
            return head
        waited, window = wait_now - self._wait_then, now - self._sampled_at
        if waited >= late / 2:
            return (
                f"{head}. The thread waited {waited:.1f} s of the last {window:.1f} s for a CPU: this "
                "process is starved of CPU. Is its core shared with a busy thread "
                "(VLLM_CPU_OMP_THREADS_BIND, taskset)?"
            )
        return (
            f"{head}. The thread waited only {waited:.1f} s of the last {window:.1f} s for a CPU, so it was "
            "blocked, not starved: a long call on this loop, or another thread holding the GIL"
        )
