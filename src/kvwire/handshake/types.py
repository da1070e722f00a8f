"""Plain data the handshake service works with: this engine, its ranks, and what a handshake yields."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.core.handshake import HandshakeManagerStats as HandshakeManagerStats
from kvwire.core.handshake_io import FailureReason as FailureReason
from kvwire.core.types import EngineInfo as EngineInfo
from kvwire.core.types import PeerAddress as PeerAddress
from kvwire.core.types import PeerRank as PeerRank
from kvwire.errors import ConfigError
from kvwire.kv.cache import KVCache
from kvwire.kv.regions import CacheMemory
from kvwire.transport.base import Agent


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
