"""Plain data the handshake service works with: this engine, its ranks, and what a handshake yields."""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field

from kvwire.core.types import EngineInfo as EngineInfo
from kvwire.core.types import PeerRank as PeerRank
from kvwire.errors import ConfigError
from kvwire.kv.cache import KVCache
from kvwire.kv.regions import CacheMemory
from kvwire.transport.base import Agent, PeerMode


@dataclass(frozen=True)
class LocalRank:
    """What this engine serves for one (pp, tp) rank: its agent and its KV cache."""

    pp_rank: int
    tp_rank: int
    agent: Agent
    cache: CacheMemory  # kvwire's own KVCache or an engine's memory (ExternalKV)

    def own_cache(self) -> KVCache:
        """The cache as kvwire's own ``KVCache`` (test harnesses and the reference engine read its slab)."""
        if not isinstance(self.cache, KVCache):
            raise ConfigError(f"rank pp{self.pp_rank}/tp{self.tp_rank} holds engine memory, not a KVCache")
        return self.cache


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Cache key of a handshake: where the peer's side channel is and which of its ranks we load."""

    host: str
    port: int
    pp_rank: int
    tp_rank: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/pp{self.pp_rank}/tp{self.tp_rank}"


class FailureReason(enum.Enum):
    """Why a handshake failed (a label of the failure counter)."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    INCOMPATIBLE = "incompatible"
    UNAUTHORIZED = "unauthorized"
    NO_SUCH_RANK = "no_such_rank"
    BAD_REPLY = "bad_reply"
    TRANSPORT = "transport"


@dataclass
class HandshakeManagerStats:
    """Running counters of one HandshakeManager (a metrics exporter reads these attributes); not
    ``kvwire.metrics.HandshakeStats``, which records one completed handshake."""

    handshakes: Counter[PeerMode] = field(default_factory=Counter)  # completed, by resulting mode
    upgrades: int = 0  # NOTIF_ONLY -> FULL, also counted in handshakes[FULL]
    deduped: int = 0  # ensure() calls that joined a handshake already in flight
    cache_hits: int = 0
    retries: int = 0
    replaced: int = 0  # entries dropped because the peer came back with a new incarnation
    forgotten: int = 0
    not_allowed: int = 0  # ensure() calls refused at once: the address is not in allowed_peers
    failures: Counter[FailureReason] = field(default_factory=Counter)
    # Most recent durations (seconds), by mode; bounded so a long-lived engine does not grow it.
    durations_s: dict[PeerMode, deque[float]] = field(
        default_factory=lambda: {mode: deque(maxlen=1024) for mode in PeerMode}
    )
