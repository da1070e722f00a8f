"""Prometheus metrics shared by the engine servers and the router.

Every server builds its own ``CollectorRegistry`` (``KvMetrics()``), never the process-global default, so
that several servers (or tests) in one process never collide on metric names and nothing is registered at
import time. Engines feed the metrics from small frozen stats records (``TransferStats``,
``HandshakeStats``, ``BlockStats``) and expose them twice: Prometheus text on ``/metrics`` and a JSON
``snapshot()`` on ``/v1/kv_stats`` (what ``kvwire demo`` reads, see ``docs``/serving-api notes).

Counting rule: a transfer is counted once, by the side that posts it (P in push mode, D in pull mode); a
handshake is counted by the side that initiates it.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvwire.protocol.messages import FailReason, TransferMode
from kvwire.transport.base import PeerMode

# Seconds. Transfers on one host run from ~0.1 ms (one small block) to seconds (GBs over TCP).
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Recent handshakes kept for the JSON snapshot: bounded, a long-lived engine must not grow without end.
_RECENT_HANDSHAKES = 256

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Outcome(enum.Enum):
    """How a served request ended (engines and router use the same values)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    ENGINE_ERROR = "engine_error"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TransferStats:
    """One finished transfer (all the WRITEs or READs of one request on one rank)."""

    mode: TransferMode
    num_bytes: int
    seconds: float
    ok: bool = True
    reason: FailReason | None = None


@dataclass(frozen=True)
class HandshakeStats:
    """One completed handshake with a peer rank; ``peer`` is a readable name (engine id or host:port)."""

    peer: str
    mode: PeerMode
    seconds: float


@dataclass(frozen=True)
class BlockStats:
    in_use: int
    quarantined: int
    total: int = 0


class KvMetrics:
    """The metric set of one server, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.transfers = Counter(
            "kvwire_transfers", "KV transfers finished, by mode and outcome", ["mode", "outcome"], registry=r
        )
        self.transfer_bytes = Counter(
            "kvwire_transfer_bytes", "KV bytes moved by successful transfers", ["mode"], registry=r
        )
        self.transfer_seconds = Histogram(
            "kvwire_transfer_seconds",
            "Duration of successful transfers (post to DONE)",
            ["mode"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.handshakes = Counter("kvwire_handshakes", "Handshakes completed, by mode", ["mode"], registry=r)
        self.handshake_seconds = Histogram(
            "kvwire_handshake_seconds",
            "Handshake duration, by mode",
            ["mode"],
            buckets=_HANDSHAKE_BUCKETS,
            registry=r,
        )
        self.failures = Counter("kvwire_failures", "Transfer failures, by reason", ["reason"], registry=r)
        self.dropped = Counter(
            "kvwire_dropped_notifications",
            "Peer notifications dropped before touching any state, by reason (malformed, wrong_sender, "
            "stale_incarnation, unknown_transfer, duplicate, overload, ...)",
            ["reason"],
            registry=r,
        )
        self.blocks_in_use = Gauge("kvwire_blocks_in_use", "KV blocks allocated", registry=r)
        self.blocks_quarantined = Gauge(
            "kvwire_blocks_quarantined", "KV blocks held back after a failed or unknown transfer", registry=r
        )
        self.blocks_total = Gauge("kvwire_blocks_total", "KV blocks in the cache", registry=r)
        self.requests = Counter(
            "kvwire_requests", "HTTP requests served, by outcome", ["outcome"], registry=r
        )
        self.request_seconds = Histogram(
            "kvwire_request_seconds",
            "Request duration, by outcome",
            ["outcome"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvwire_ttft_seconds", "Time to first token", buckets=_REQUEST_BUCKETS, registry=r
        )
        # The JSON snapshot keeps exact sums (histograms only expose them through the registry).
        self._lock = threading.Lock()
        self._recent: deque[HandshakeStats] = deque(maxlen=_RECENT_HANDSHAKES)
        self._ok_transfers = 0
        self._ok_bytes = 0
        self._ok_seconds = 0.0
        self._failed_transfers = 0
        self._blocks = BlockStats(in_use=0, quarantined=0)

    # -- updates (thread-safe: engines call them from worker threads) ----------------------------------

    def record_transfer(self, stats: TransferStats) -> None:
        mode = stats.mode.value
        if stats.ok:
            self.transfers.labels(mode=mode, outcome="ok").inc()
            self.transfer_bytes.labels(mode=mode).inc(stats.num_bytes)
            self.transfer_seconds.labels(mode=mode).observe(stats.seconds)
        else:
            self.transfers.labels(mode=mode, outcome="failed").inc()
            if stats.reason is not None:
                self.failures.labels(reason=stats.reason.value).inc()
        with self._lock:
            if stats.ok:
                self._ok_transfers += 1
                self._ok_bytes += stats.num_bytes
                self._ok_seconds += stats.seconds
            else:
                self._failed_transfers += 1

    def record_failure(self, reason: FailReason) -> None:
        """A failure that is not tied to one posted transfer (handshake failed, fence expired, ...)."""
        self.failures.labels(reason=reason.value).inc()

    def record_dropped(self, reason: str, count: int = 1) -> None:
        self.dropped.labels(reason=reason).inc(count)

    def record_handshake(self, stats: HandshakeStats) -> None:
        self.handshakes.labels(mode=stats.mode.value).inc()
        self.handshake_seconds.labels(mode=stats.mode.value).observe(stats.seconds)
        with self._lock:
            self._recent.append(stats)

    def set_blocks(self, stats: BlockStats) -> None:
        with self._lock:
            self._blocks = stats
        self.blocks_in_use.set(stats.in_use)
        self.blocks_quarantined.set(stats.quarantined)
        if stats.total:
            self.blocks_total.set(stats.total)

    def record_request(self, outcome: Outcome, seconds: float, ttft_s: float | None = None) -> None:
        self.requests.labels(outcome=outcome.value).inc()
        self.request_seconds.labels(outcome=outcome.value).observe(seconds)
        if ttft_s is not None:
            self.ttft_seconds.observe(ttft_s)

    # -- exposition ------------------------------------------------------------------------------------

    def render(self) -> bytes:
        """Prometheus text exposition (serve it with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready totals for ``GET /v1/kv_stats``."""
        with self._lock:
            recent = list(self._recent)
            transfers, num_bytes, seconds = self._ok_transfers, self._ok_bytes, self._ok_seconds
            failed = self._failed_transfers
            blocks = self._blocks
        return {
            "transfers": transfers,
            "failed_transfers": failed,
            "bytes": num_bytes,
            "transfer_seconds": seconds,
            "gbps": (num_bytes / seconds / 1e9) if seconds > 0 else None,
            "handshakes": [
                {"peer": h.peer, "notif_only": h.mode is PeerMode.NOTIF_ONLY, "ms": h.seconds * 1e3}
                for h in recent
            ],
            "blocks_in_use": blocks.in_use,
            "blocks_quarantined": blocks.quarantined,
        }
