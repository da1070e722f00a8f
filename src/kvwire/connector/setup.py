"""A connector's start-up checks: what is refused before anything registers memory or binds a port.

Each refusal is a ``ConfigError`` that names the fix, raised from the connector's constructor, so a
misconfigured engine ends at start-up with one line instead of failing its first request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.config import WILDCARD_HOSTS
from kvwire.core.config import ConnectorConfig
from kvwire.errors import ConfigError
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.types import MemKind


def checked_setup(
    engine: EngineInfo,
    config: ConnectorConfig,
    ranks: Sequence[LocalRank],
    host: str,
    advertise_host: str | None,
) -> tuple[dict[RankKey, LocalRank], str]:
    """The local ranks by (pp, tp), and the address peers dial; ConfigError naming the fix otherwise."""
    if config.mode is not engine.transfer_mode:
        raise ConfigError(f"config mode {config.mode.value} != engine's {engine.transfer_mode.value}")
    by_key = {(r.pp_rank, r.tp_rank): r for r in ranks}
    if not ranks or len(by_key) != len(ranks):
        raise ConfigError("a connector needs at least one local rank, each (pp, tp) once")
    in_device = [key for key, r in by_key.items() if r.cache.mem_kind is not MemKind.DRAM]
    if config.kv_digest_sample > 0 and in_device:
        # The digest reads host memory (kv/digest.py): every sampled request would fail digest_mismatch.
        raise ConfigError(
            f"kv_digest_sample={config.kv_digest_sample} but the KV of ranks {in_device} is in device "
            "memory, which the digest cannot read: set kv_digest_sample to 0 (done's reg_nonce and nbytes "
            "still check every transfer)"
        )
    advertised = advertise_host or host
    if advertised in WILDCARD_HOSTS:
        raise ConfigError(
            f"side channel bound to {host!r} (every interface) but no address to advertise: set "
            "KVWIRE_SIDE_CHANNEL_HOST (or advertise_host) to the address peers should dial"
        )
    return by_key, advertised
