"""What the connector reports to its engine (events from ``poll()``) and counts (stats for metrics)."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from kvwire.protocol.messages import FailReason


class ProducerOutcome(enum.Enum):
    """How P's hold on a finished request's blocks ended."""

    SENT = "sent"  # every registration of every local rank ended with a completed write
    FAILED = "failed"  # at least one registration ended in failure (D was told)
    EXPIRED = "expired"  # the lease ran out before every expected registration ended
    ABORTED = "aborted"  # the engine aborted the request
    PULLED = "pulled"  # pull mode: D read the blocks and said done
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class ProducerEvent:
    """P's blocks for ``transfer_id`` may be freed now (exactly one per ``request_finished``)."""

    transfer_id: str
    outcome: ProducerOutcome


class ConsumerEventKind(enum.Enum):
    READY = "ready"  # the request's KV is complete in its blocks: decoding may start
    FAILED = "failed"  # the KV will not come; the blocks stay fenced until RELEASED
    RELEASED = "released"  # no peer can write (or is reading) into the request's blocks any more


@dataclass(frozen=True, slots=True)
class ConsumerEvent:
    """One request's news on D.

    Every ``request_allocated`` ends with exactly one of: READY (the blocks are the engine's), or
    RELEASED (after FAILED, or after the engine's own ``abort``). After FAILED the engine must not reuse
    or recompute into the blocks before RELEASED.
    """

    transfer_id: str
    kind: ConsumerEventKind
    reason: FailReason | None = None


@dataclass
class ConnectorStats:
    """Counters of one Producer or Consumer; attributes a Prometheus exporter can read."""

    transfers_started: int = 0
    transfers_done: int = 0
    bytes_moved: int = 0
    descriptors_posted: int = 0
    failures: Counter[FailReason] = field(default_factory=Counter)
    # Notifications dropped before touching any state, by why (malformed, stale, unknown_transfer, ...).
    dropped_notifs: Counter[str] = field(default_factory=Counter)
    handshakes_started: int = 0
    handshakes_failed: int = 0
    peers_declared_dead: int = 0
    peers_reaped: int = 0  # idle past engine_ttl_s: agents unloaded
    heartbeats_sent: int = 0
    cancels: int = 0
    # D: a dead P life's blocks released at the quarantine bound, never confirmed gone (see docs).
    quarantine_expired: int = 0
    # P: ended requests forgotten before tombstone_s, past max_tombstones.
    tombstones_dropped: int = 0
    # KV digests computed (P: over its source, for a D that asked; D: over the landed bytes, compared).
    digests: int = 0
    # D: requests it declined (the engine will not load them) whose P ranks it set out to tell.
    declined: int = 0
    # Most recent transfer durations (seconds, post to DONE), bounded.
    transfer_durations_s: list[float] = field(default_factory=list)
    # Durations recorded in all (one per transfer in push, one per READ in pull): the list keeps the last.
    durations_recorded: int = 0

    def record_duration(self, seconds: float, keep: int = 1024) -> None:
        self.durations_recorded += 1
        self.transfer_durations_s.append(seconds)
        if len(self.transfer_durations_s) > keep:
            del self.transfer_durations_s[: len(self.transfer_durations_s) - keep]
