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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvwire.protocol.messages import FailReason, TransferMode
from kvwire.protocol.types import PeerMode

# Seconds. Transfers on one host run from ~0.1 ms (one small block) to seconds (GBs over TCP).
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Bytes of one transfer: a few blocks of a tiny model (KiBs) to long prompts of a large one (GiBs).
SIZE_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
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


class MetricRole(enum.Enum):
    """Which process exports the metrics: the value of every family's ``role`` label."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    ROUTER = "router"


_CONNECTED = (MetricRole.PREFILL, MetricRole.DECODE)
_ENGINES = (*_CONNECTED, MetricRole.COLOCATED)


def posts_transfers(role: MetricRole, mode: TransferMode | None) -> bool:
    """The side that posts the transfers, and so counts them: P in push mode, D in pull mode."""
    if mode is None or role not in _CONNECTED:
        return False
    return (role is MetricRole.PREFILL) == (mode is TransferMode.PUSH)


class KvMetrics:
    """The metric set of one server, on its own registry.

    Each process exports only the families its role fills (the router no transfer family, the colocated
    engine no handshake family, the side that does not post transfers no transfer family), every sample
    labelled with ``role`` and ``model_name`` (see docs/metrics.md for the mapping to vLLM's names).
    A ``record_*`` call for a family this role does not export only updates the JSON snapshot.
    """

    def __init__(
        self,
        role: MetricRole = MetricRole.PREFILL,
        model_name: str = "kvwire",
        *,
        transfers: bool = True,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.role = role
        self.model_name = model_name
        self._base = {"role": role.value, "model_name": model_name}
        r, base = self.registry, ["role", "model_name"]
        self.requests = Counter(
            "kvwire_requests", "HTTP requests served, by outcome", [*base, "outcome"], registry=r
        )
        self.request_seconds = Histogram(
            "kvwire_request_seconds",
            "Request duration (arrival to last byte), by outcome",
            [*base, "outcome"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvwire_ttft_seconds",
            "Time to first token: the client's at the router; an engine's own first token on an engine "
            "(on P that is its one-token prefill leg)",
            base,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self._router_families(role is MetricRole.ROUTER, base)
        for family in (self.ttft_seconds, self.itl_seconds, self.e2e_seconds):
            if family is not None:
                family.labels(**self._base)  # exported (at zero) from the start, not after the first request
        self._decode_families(role is MetricRole.DECODE, base)
        self._engine_families(role in _ENGINES, base)
        self._kv_families(role in _CONNECTED, base)
        self._transfer_families(transfers and role in _CONNECTED, base)
        # The JSON snapshot keeps exact sums (histograms only expose them through the registry).
        self._lock = threading.Lock()
        self._recent: deque[HandshakeStats] = deque(maxlen=_RECENT_HANDSHAKES)
        self._ok_transfers = 0
        self._ok_bytes = 0
        self._ok_seconds = 0.0
        self._failed_transfers = 0
        self._blocks = BlockStats(in_use=0, quarantined=0)

    def _router_families(self, on: bool, base: list[str]) -> None:
        r = self.registry
        self.itl_seconds: Histogram | None = None
        self.e2e_seconds: Histogram | None = None
        if on:
            self.itl_seconds = Histogram(
                "kvwire_inter_token_latency_seconds",
                "Time between consecutive output tokens of a request, as the client sees them",
                base,
                buckets=_ITL_BUCKETS,
                registry=r,
            )
            self.e2e_seconds = Histogram(
                "kvwire_e2e_request_latency_seconds",
                "End-to-end latency of a successful request at the router (arrival to last token)",
                base,
                buckets=_REQUEST_BUCKETS,
                registry=r,
            )

    def _decode_families(self, on: bool, base: list[str]) -> None:
        r = self.registry
        self.kv_wait_seconds: Histogram | None = None
        if on:
            self.kv_wait_seconds = Histogram(
                "kvwire_kv_wait_seconds",
                "D: time from allocating a request's blocks to its KV being complete (registration, P's "
                "prefill if still running, the transfer)",
                base,
                buckets=_REQUEST_BUCKETS,
                registry=r,
            )
            self.kv_wait_seconds.labels(**self._base)

    def _engine_families(self, on: bool, base: list[str]) -> None:
        r = self.registry
        self.blocks_in_use: Gauge | None = None
        self.blocks_quarantined: Gauge | None = None
        self.blocks_total: Gauge | None = None
        if on:
            self.blocks_in_use = Gauge("kvwire_blocks_in_use", "KV blocks allocated", base, registry=r)
            self.blocks_quarantined = Gauge(
                "kvwire_blocks_quarantined", "KV blocks held back after a failed or unknown transfer", base,
                registry=r,
            )  # fmt: skip
            self.blocks_total = Gauge("kvwire_blocks_total", "KV blocks in the cache", base, registry=r)

    def _kv_families(self, on: bool, base: list[str]) -> None:
        r = self.registry
        self.handshakes: Counter | None = None
        self.handshake_seconds: Histogram | None = None
        self.failures: Counter | None = None
        self.dropped: Counter | None = None
        self.digests: Counter | None = None
        self.declined: Counter | None = None
        self.refused_connections: Counter | None = None
        self.circuit_open: Counter | None = None
        self.side_refusals: Counter | None = None
        self.handshake_failures: Counter | None = None
        if not on:
            return
        self.side_refusals = Counter(
            "kvwire_side_channel_refusals",
            "Requests this side channel refused, by reason (an ErrorCode: unauthorized, bad_request, "
            "incompatible, no_such_rank): probing for the secret and malformed peers show here",
            [*base, "reason"],
            registry=r,
        )
        self.handshake_failures = Counter(
            "kvwire_handshake_failures",
            "Handshakes this engine started that failed, by reason (timeout, unreachable, incompatible, "
            "replaced, unauthorized, no_such_rank, bad_reply, transport)",
            [*base, "reason"],
            registry=r,
        )
        self.digests = Counter(
            "kvwire_kv_digests",
            "KV digests computed: P over its source for a D that asked, D over the bytes that landed "
            "(each compared; a mismatch is a digest_mismatch failure)",
            base,
            registry=r,
        )
        self.declined = Counter(
            "kvwire_declined",
            "Decode requests this engine dropped before loading their KV (a client gone while the request "
            "queued), whose P it told to free the prompt's blocks at once rather than at its lease",
            base,
            registry=r,
        )
        self.refused_connections = Counter(
            "kvwire_refused_connections",
            "Side-channel connections closed by the listener's limits, by reason (over_limit: refused at "
            "accept; evicted_idle: an idle unauthenticated one closed to admit a newcomer)",
            [*base, "reason"],
            registry=r,
        )
        self.circuit_open = Counter(
            "kvwire_handshake_circuit_open",
            "Handshakes refused at once because their address's circuit breaker was open",
            base,
            registry=r,
        )
        self.handshakes = Counter(
            "kvwire_handshakes", "Handshakes completed, by mode", [*base, "mode"], registry=r
        )
        self.handshake_seconds = Histogram(
            "kvwire_handshake_seconds", "Handshake duration, by mode", [*base, "mode"],
            buckets=_HANDSHAKE_BUCKETS, registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "kvwire_failures", "Transfer failures, by reason", [*base, "reason"], registry=r
        )
        self.dropped = Counter(
            "kvwire_dropped_notifications",
            "Peer notifications dropped before touching any state, by reason (malformed, wrong_sender, "
            "stale_incarnation, unknown_transfer, duplicate, overload, ...)",
            [*base, "reason"],
            registry=r,
        )

    def _transfer_families(self, on: bool, base: list[str]) -> None:
        r = self.registry
        self.transfers: Counter | None = None
        self.transfer_bytes: Counter | None = None
        self.transfer_seconds: Histogram | None = None
        self.transfer_size: Histogram | None = None
        if not on:
            return
        self.transfers = Counter(
            "kvwire_transfers", "KV transfers finished, by mode and outcome", [*base, "mode", "outcome"],
            registry=r,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            "kvwire_transfer_bytes", "KV bytes moved by successful transfers", [*base, "mode"], registry=r
        )
        self.transfer_seconds = Histogram(
            "kvwire_transfer_seconds",
            "Duration of successful transfers (post to DONE)",
            [*base, "mode"],
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_size = Histogram(
            "kvwire_transfer_size_bytes",
            "KV bytes of each successful transfer",
            [*base, "mode"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )

    # -- updates (thread-safe: engines call them from worker threads) ----------------------------------

    def record_transfer(self, stats: TransferStats) -> None:
        mode, base = stats.mode.value, self._base
        count, moved, took = self.transfers, self.transfer_bytes, self.transfer_seconds
        if count is not None and moved is not None and took is not None:
            if stats.ok:
                count.labels(**base, mode=mode, outcome="ok").inc()
                moved.labels(**base, mode=mode).inc(stats.num_bytes)
                took.labels(**base, mode=mode).observe(stats.seconds)
                if self.transfer_size is not None:
                    self.transfer_size.labels(**base, mode=mode).observe(stats.num_bytes)
            else:
                count.labels(**base, mode=mode, outcome="failed").inc()
        if not stats.ok and stats.reason is not None:
            self.record_failure(stats.reason)
        with self._lock:
            if stats.ok:
                self._ok_transfers += 1
                self._ok_bytes += stats.num_bytes
                self._ok_seconds += stats.seconds
            else:
                self._failed_transfers += 1

    def record_failure(self, reason: FailReason) -> None:
        """A failure that is not tied to one posted transfer (handshake failed, fence expired, ...)."""
        if self.failures is not None:
            self.failures.labels(**self._base, reason=reason.value).inc()

    def record_digests(self, count: int) -> None:
        if self.digests is not None:
            self.digests.labels(**self._base).inc(count)

    def record_declined(self, count: int) -> None:
        if self.declined is not None:
            self.declined.labels(**self._base).inc(count)

    def record_dropped(self, reason: str, count: int = 1) -> None:
        if self.dropped is not None:
            self.dropped.labels(**self._base, reason=reason).inc(count)

    def record_refused_connections(self, reason: str, count: int) -> None:
        if self.refused_connections is not None and count > 0:
            self.refused_connections.labels(**self._base, reason=reason).inc(count)

    def record_side_refusals(self, reason: str, count: int) -> None:
        if self.side_refusals is not None and count > 0:
            self.side_refusals.labels(**self._base, reason=reason).inc(count)

    def record_handshake_failures(self, reason: str, count: int) -> None:
        if self.handshake_failures is not None and count > 0:
            self.handshake_failures.labels(**self._base, reason=reason).inc(count)

    def record_circuit_open(self, count: int) -> None:
        if self.circuit_open is not None and count > 0:
            self.circuit_open.labels(**self._base).inc(count)

    def record_handshake(self, stats: HandshakeStats) -> None:
        if self.handshakes is not None and self.handshake_seconds is not None:
            self.handshakes.labels(**self._base, mode=stats.mode.value).inc()
            self.handshake_seconds.labels(**self._base, mode=stats.mode.value).observe(stats.seconds)
        with self._lock:
            self._recent.append(stats)

    def set_blocks(self, stats: BlockStats) -> None:
        with self._lock:
            self._blocks = stats
        if self.blocks_in_use is None or self.blocks_quarantined is None or self.blocks_total is None:
            return
        self.blocks_in_use.labels(**self._base).set(stats.in_use)
        self.blocks_quarantined.labels(**self._base).set(stats.quarantined)
        if stats.total:
            self.blocks_total.labels(**self._base).set(stats.total)

    def record_request(
        self,
        outcome: Outcome,
        seconds: float,
        ttft_s: float | None = None,
        token_gaps_s: Sequence[float] = (),
    ) -> None:
        """One served request; at the router, ``token_gaps_s`` are the times between its output tokens."""
        base = self._base
        self.requests.labels(**base, outcome=outcome.value).inc()
        self.request_seconds.labels(**base, outcome=outcome.value).observe(seconds)
        if ttft_s is not None:
            self.ttft_seconds.labels(**base).observe(ttft_s)
        if self.itl_seconds is not None:
            for gap in token_gaps_s:
                self.itl_seconds.labels(**base).observe(gap)
        if self.e2e_seconds is not None and outcome is Outcome.OK:
            self.e2e_seconds.labels(**base).observe(seconds)

    def record_kv_wait(self, seconds: float) -> None:
        if self.kv_wait_seconds is not None:
            self.kv_wait_seconds.labels(**self._base).observe(seconds)

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
