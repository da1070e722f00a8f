"""What an engine publishes about itself in etcd, and under which key.

One key per engine: ``{prefix}/engines/{role}/{quoted HTTP URL}``. Keyed by URL (what the router sends
requests to), so an engine restarted on the same address overwrites its previous life's record at once,
new incarnation and side channel included, instead of waiting for the old lease to expire. The value is a
JSON ``EngineRecord`` written under the engine's lease: it disappears when the engine stops renewing it.
"""

from __future__ import annotations

import enum
import urllib.parse

import msgspec

# A record is a few hundred bytes; anything much larger under our prefix is not one of ours.
MAX_RECORD_BYTES = 64 << 10


class FleetRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class SideChannel(msgspec.Struct, frozen=True):
    """One rank's side channel (vLLM engines listen on one port per rank; kvwire's reference engine on one
    port for all its ranks, listed once per rank)."""

    pp_rank: int
    tp_rank: int
    host: str
    port: int


class RecordLoad(msgspec.Struct, frozen=True):
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0  # in the engine's prefix cache
    prefix_query_tokens: int = 0  # prompt tokens admitted with the prefix cache on, since start
    prefix_hit_tokens: int = 0  # of which found in the cache


class EngineRecord(msgspec.Struct, frozen=True):
    role: FleetRole
    engine_id: str
    incarnation: str
    model: str
    url: str  # the engine's HTTP API, as the router reaches it
    side_channel_host: str
    side_channel_port: int
    compat: str = ""  # the engine's compat hash (model, seed, KV layout, mode): equal ones can pair
    side_channels: tuple[SideChannel, ...] = ()
    tp_size: int = 1
    pp_size: int = 1
    seed: int | None = None
    mode: str | None = None
    authenticated: bool | None = None
    load: RecordLoad = RecordLoad()
    kv_blocks: int = 0  # the KV cache's size in blocks of block_size tokens (0: not said)
    block_size: int = 0
    draining: bool = False  # SIGTERM received: finish what it has, take nothing new
    updated: float = 0.0  # the engine's wall clock when written (for people reading etcd)


def engine_key(prefix: str, role: FleetRole, url: str) -> str:
    return f"{prefix}/engines/{role.value}/{urllib.parse.quote(url, safe='')}"


def engines_prefix(prefix: str) -> str:
    return f"{prefix}/engines/"


_decoder = msgspec.json.Decoder(EngineRecord)


def encode(record: EngineRecord) -> bytes:
    return msgspec.json.encode(record)


def decode(raw: bytes) -> EngineRecord:
    """Raises ``ValueError`` for a value that is not a valid record (the watcher skips and counts it)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(raw)} bytes is over {MAX_RECORD_BYTES}")
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
