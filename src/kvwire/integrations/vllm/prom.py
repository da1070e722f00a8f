"""kvwire's counters on vLLM's own stats path: the "KV Transfer metrics" log line and ``/metrics``.

``KvwireStats`` is what ``get_kv_connector_stats`` returns (vLLM sums it over workers and steps);
``KvwirePromMetrics`` turns each payload into ``vllm:kvwire_*`` families on the API server's
``/metrics``, named as the engine server's ``kvwire_*`` families (docs/metrics.md) with vLLM's prefix and
its ``model_name``/``engine`` labels. The payload's shape and arithmetic live in ``stats`` (no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvwire.integrations.vllm.stats import COUNTS, SECONDS, SIZES, is_empty, merge, payload, summary
from kvwire.metrics import SIZE_BUCKETS, TRANSFER_BUCKETS


@dataclass
class KvwireStats(KVConnectorStats):  # type: ignore[misc]
    """One or more steps' changes, from any number of workers and the scheduler."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = payload({})

    def reset(self) -> None:
        self.data = payload({})

    def aggregate(self, other: KVConnectorStats) -> KvwireStats:
        if not other.is_empty():
            self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


# Counts without a label: key -> (family, help).
_PLAIN = {
    "transfers": ("vllm:kvwire_transfers", "KV transfers this engine posted that finished (P in push mode)"),
    "bytes": ("vllm:kvwire_transfer_bytes", "KV bytes moved by the transfers this engine posted"),
    "digests": ("vllm:kvwire_kv_digests", "KV digests computed (verify_digest)"),
    "declined": (
        "vllm:kvwire_declined",
        "Decode requests this engine dropped before loading their KV, whose P it told to free the prompt",
    ),
    "peers_declared_dead": ("vllm:kvwire_peers_declared_dead", "Peer lives declared dead by heartbeats"),
    "circuit_open": (
        "vllm:kvwire_handshake_circuit_open",
        "Handshakes refused at once because their address's circuit breaker was open",
    ),
    "rejected_params": (
        "vllm:kvwire_rejected_params",
        "Requests whose kv_transfer_params were malformed: prefilled locally instead (see the log)",
    ),
}
# Counts by the part of their key after ':': prefix -> (family, label, help).
_LABELLED = {
    "failure": ("vllm:kvwire_failures", "reason", "Requests whose KV transfer failed, by reason"),
    "dropped": (
        "vllm:kvwire_dropped_notifications",
        "reason",
        "Peer notifications dropped before touching any state, by reason",
    ),
    "handshakes": ("vllm:kvwire_handshakes", "mode", "Handshakes completed, by mode"),
    "handshake": ("vllm:kvwire_handshake_failures", "reason", "Handshakes started here that failed"),
    "refusal": ("vllm:kvwire_side_channel_refusals", "reason", "Side-channel requests refused, by code"),
    "refused": (
        "vllm:kvwire_refused_connections",
        "reason",
        "Side-channel connections closed by the listener's limits (over_limit, evicted_idle)",
    ),
}


class KvwirePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Registers the ``vllm:kvwire_*`` families once per API server; ``observe`` adds one payload."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        self._plain = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in _PLAIN.items()
        }
        self._labelled = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            for key, (name, label, doc) in _LABELLED.items()
        }
        self._seconds = self._histogram_cls(
            name="vllm:kvwire_transfer_seconds",
            documentation="Duration of the transfers this engine posted (post to done)",
            buckets=list(TRANSFER_BUCKETS),
            labelnames=labelnames,
        )
        self._sizes = self._histogram_cls(
            name="vllm:kvwire_transfer_size_bytes",
            documentation="KV bytes of each transfer this engine posted (the interval's mean)",
            buckets=list(SIZE_BUCKETS),
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for key, n in transfer_stats_data.get(COUNTS, {}).items():
            prefix, _, value = key.partition(":")
            if value and prefix in self._labelled:
                self._labelled[prefix].labels(*engine, value).inc(n)
            elif key in self._plain:
                self._plain[key].labels(*engine).inc(n)
        for secs in transfer_stats_data.get(SECONDS, []):
            self._seconds.labels(*engine).observe(secs)
        for size in transfer_stats_data.get(SIZES, []):
            self._sizes.labels(*engine).observe(size)
