"""Per-request timelines: when each step of a transfer happened, for finding where latency goes.

Each process marks the steps it sees (the engine server: arrival, KV allocated, first token, answer; the
connector's loop: push_reg sent or received, write posted, done). Times are ``time.monotonic()`` (the
connector marks with its injected clock, which is that by default), one clock for every process of a host
(CLOCK_MONOTONIC), so a benchmark can line up P's, D's and its own marks. Bounded: the oldest requests
are dropped first.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from typing import Any


class Stage(enum.Enum):
    """A step of one request's life, in the order a disaggregated request usually passes them."""

    ARRIVED = "arrived"  # the engine server took the HTTP request
    KV_ALLOCATED = "kv_allocated"  # D: blocks allocated and handed to the connector (engine thread)
    LOOP_RECEIVED = "loop_received"  # the connector's loop took the engine's call (allocated/finished)
    PUSH_REG_SENT = "push_reg_sent"  # D: the push_reg left
    PUSH_REG_RECEIVED = "push_reg_received"  # P: the push_reg was drained from the agent
    PREFILL_DONE = "prefill_done"  # P: the prompt's token was sampled (request_finished follows)
    WRITE_POSTED = "write_posted"  # P: the WRITE (with the done notification) was posted
    WRITE_DONE = "write_done"  # P: NIXL reported the WRITE complete
    DONE_RECEIVED = "done_received"  # D: the done notification was drained from the agent
    KV_READY = "kv_ready"  # D: the engine thread took READY
    FIRST_TOKEN = "first_token"  # the first output token was sampled
    ANSWERED = "answered"  # the server handed the (first) answer to the HTTP layer


_CAPACITY = 1024


class Timeline:
    """``transfer id -> {stage: time}`` for the most recent requests; thread-safe (the loop thread marks,
    an HTTP handler reads)."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._capacity = capacity
        self._records: OrderedDict[str, dict[Stage, float]] = OrderedDict()
        self._lock = threading.Lock()

    def mark(self, key: str, stage: Stage, at: float) -> None:
        """Record ``stage`` of ``key`` at ``at``; the first mark of a stage wins (a retry keeps the
        first attempt's time, which is what the request waited from)."""
        if not key:
            return
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                rec = self._records[key] = {}
                if len(self._records) > self._capacity:
                    self._records.popitem(last=False)
            rec.setdefault(stage, at)

    def get(self, key: str) -> dict[Stage, float]:
        with self._lock:
            return dict(self._records.get(key, {}))

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._records)


def merged(key: str, *timelines: Timeline) -> dict[str, Any]:
    """One request's marks from several timelines (the server's and its connector's), as JSON."""
    out: dict[str, Any] = {"id": key}
    for tl in timelines:
        for stage, at in tl.get(key).items():
            out.setdefault(stage.value, at)
    return out
