"""kvwire's counters inside vLLM, in the shape vLLM's stats path carries (no vLLM import here).

vLLM asks each worker and its scheduler after every step for what changed (``get_kv_connector_stats``),
sums the answers over workers and steps in the engine core (``KVConnectorStats.aggregate``), logs a
summary every stats interval (``reduce``: "KV Transfer metrics: ...") and adds each payload to the
Prometheus families on the API server's ``/metrics`` (``prom.KvwirePromMetrics``). The payload crosses
processes, so it is plain data: ``{"counts": {key: n}, "transfer_s": [...], "transfer_bytes": [...]}``
with the keys of ``kvwire.connector.totals`` (and ``rejected_params`` from the scheduler).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvwire.connector._base import ConnectorBase
from kvwire.connector.totals import Deltas, counter_totals

# Samples of transfer time and size one payload carries: a burst between two looks keeps its latest.
MAX_SAMPLES = 512
COUNTS, SECONDS, SIZES = "counts", "transfer_s", "transfer_bytes"
REJECTED = "rejected_params"  # scheduler: malformed kv_transfer_params, the request prefilled locally


def payload(
    counts: dict[str, int], seconds: list[float] | None = None, sizes: list[int] | None = None
) -> dict[str, Any]:
    return {COUNTS: {k: n for k, n in counts.items() if n > 0}, SECONDS: seconds or [], SIZES: sizes or []}


def is_empty(data: dict[str, Any]) -> bool:
    return not data.get(COUNTS) and not data.get(SECONDS)


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A new payload: counts summed, samples appended up to ``MAX_SAMPLES``. Neither input changes (vLLM
    aggregates into the first payload it got, which other loggers may still read)."""
    counts = dict(a.get(COUNTS, {}))
    for key, n in b.get(COUNTS, {}).items():
        counts[key] = counts.get(key, 0) + int(n)
    merged: dict[str, Any] = {COUNTS: counts}
    for key in (SECONDS, SIZES):
        merged[key] = (list(a.get(key, [])) + list(b.get(key, [])))[-MAX_SAMPLES:]
    return merged


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval's line in vLLM's log: transfers, MB moved, mean and p90 time, then every other count."""
    counts: dict[str, int] = dict(data.get(COUNTS, {}))
    out: dict[str, int | float] = {}
    if (n := counts.pop("transfers", 0)) > 0:
        secs = sorted(data.get(SECONDS, [])) or [0.0]
        out["transfers"] = n
        out["MB moved"] = round(counts.pop("bytes", 0) / 1e6, 3)
        out["mean transfer ms"] = round(sum(secs) / len(secs) * 1e3, 3)
        out["p90 transfer ms"] = round(secs[min(len(secs) - 1, int(0.9 * len(secs)))] * 1e3, 3)
    out.update(sorted(counts.items()))
    return out


class StepStats:
    """What one worker's connectors did since the previous ``take``: ``None`` when nothing did (vLLM then
    carries no stats for this step)."""

    def __init__(self) -> None:
        self._deltas: dict[int, Deltas] = {}
        self._timed: dict[int, int] = {}  # durations recorded, by connector, at the last take

    def take(self, connectors: Iterable[ConnectorBase[Any]]) -> dict[str, Any] | None:
        data = payload({})
        for c in connectors:
            counts = self._deltas.setdefault(id(c), Deltas()).take(counter_totals(c))
            new = counts.get("transfers", 0)
            # The durations recorded since the last take (a pull request records one per READ, so their
            # count is not ``new``); none on the side that does not post transfers.
            recorded, durations = c.stats.durations_recorded, list(c.stats.transfer_durations_s)
            timed = recorded - self._timed.get(id(c), 0)
            self._timed[id(c)] = recorded
            seconds = durations[-timed:] if timed > 0 else []  # only the posting side records any
            # Sizes are not kept per transfer: each new one is shown at the interval's mean.
            sizes = [counts.get("bytes", 0) // new] * min(new, MAX_SAMPLES) if new else []
            data = merge(data, payload(counts, seconds, sizes))
        return None if is_empty(data) else data
