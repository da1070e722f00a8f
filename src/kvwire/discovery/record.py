"""What an engine publishes about itself in etcd, and under which key.

One key per engine: ``{prefix}/engines/{role}/{quoted HTTP URL}``. Keyed by URL (what the router sends
requests to), so an engine restarted on the same address overwrites its previous life's record at once,
new incarnation and side channel included, instead of waiting for the old lease to expire. The value is a
JSON ``EngineRecord`` written under the engine's lease: it disappears when the engine stops renewing it.
"""

from __future__ import annotations

import enum
import urllib.parse
from typing import Annotated

import msgspec

# A record is a few hundred bytes; anything much larger under our prefix is not one of ours.
MAX_RECORD_BYTES = 64 << 10
# The bounds an engine's /health is held to (router/health.py), checked on decode: anyone who can write
# under the prefix writes records, and a port of 99999 or a tp_size of 0 is no engine the router can use.
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class FleetRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class SideChannel(msgspec.Struct, frozen=True):
    """One rank's side channel (vLLM engines listen on one port per rank; kvwire's reference engine on one
    port for all its ranks, listed once per rank)."""

    pp_rank: NonNeg
    tp_rank: NonNeg
    host: str
    port: Port


class RecordLoad(msgspec.Struct, frozen=True):
    running: NonNeg = 0
    waiting: NonNeg = 0
    free_blocks: NonNeg = 0
    cached_blocks: NonNeg = 0  # in the engine's prefix cache
    prefix_query_tokens: NonNeg = 0  # prompt tokens admitted with the prefix cache on, since start
    prefix_hit_tokens: NonNeg = 0  # of which found in the cache


class EngineRecord(msgspec.Struct, frozen=True):
    role: FleetRole
    engine_id: str
    incarnation: str
    model: str
    url: str  # the engine's HTTP API, as the router reaches it
    side_channel_host: str
    side_channel_port: Port
    compat: str = ""  # the engine's compat hash (model, seed, KV layout, mode): equal ones can pair
    side_channels: tuple[SideChannel, ...] = ()
    tp_size: Positive = 1
    pp_size: Positive = 1
    seed: int | None = None
    mode: str | None = None
    authenticated: bool | None = None
    load: RecordLoad = RecordLoad()
    kv_blocks: NonNeg = 0  # the KV cache's size in blocks of block_size tokens (0: not said)
    block_size: NonNeg = 0
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
