"""What the router knows of one engine (``HealthInfo``), whatever kind of engine it is.

Each engine kind (``kvwire.router.dialects``) fills it its own way: kvwire's engines say all of it in their
``/health``; a vLLM engine's identity is in its configured URL's fragment or its discovery record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvwire.protocol.messages import TransferMode
from kvwire.router.policy import Load

_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class _LoadBody(msgspec.Struct):
    running: _Count = 0
    waiting: _Count = 0
    free_blocks: _Count = 0


class _HealthBody(msgspec.Struct):
    """A kvwire engine's ``/health`` (``kvwire.engine.server``); fields it does not name are ignored."""

    role: str
    engine_id: str
    side_channel_host: str
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    status: str = "ok"
    incarnation: str = ""
    tp_size: _Size = 1
    pp_size: _Size = 1
    model: str = ""
    load: _LoadBody | None = None
    seed: int | None = None
    mode: TransferMode | None = None
    authenticated: bool | None = None
    compat: Annotated[str, msgspec.Meta(max_length=128)] = ""
    kv_blocks: _Count = 0
    block_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0


@dataclass(frozen=True)
class HealthInfo:
    """The fields of an engine's ``/health`` the router needs."""

    role: str
    engine_id: str
    incarnation: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int
    pp_size: int
    model: str
    load: Load
    # What must agree between P and D, when the engine says (kvwire engines do; vLLM's /health does not).
    seed: int | None = None
    mode: TransferMode | None = None
    authenticated: bool | None = None  # KVWIRE_SECRET set
    # The engine's compat hash (its handshake's: model, KV geometry, mode, wire version); "" unknown. Only
    # equal ones can exchange KV: a rolling upgrade's two generations are paired within each.
    compat: str = ""
    kv_tokens: int = 0  # the KV cache's size in tokens, when the engine says (sizes the prefix index)
    # Each rank's side-channel host, rank (pp, tp) at pp * tp_size + tp, when the ranks are on several
    # hosts (a multi-node vLLM engine's record); () when all are at side_channel_host.
    side_channel_hosts: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> HealthInfo:
        """``ValueError`` naming the field on a body that does not follow the API (a missing field, a wrong
        type, a count out of range: one engine's odd answer makes that engine unhealthy, nothing more)."""
        try:
            b = msgspec.convert(body, _HealthBody)
        except msgspec.ValidationError as exc:
            raise ValueError(f"/health does not follow the API: {exc}") from None
        load = b.load or _LoadBody()
        if b.status != "ok":
            raise ValueError(f"status {b.status!r}")
        return cls(
            role=b.role, engine_id=b.engine_id, incarnation=b.incarnation,
            side_channel_host=b.side_channel_host, side_channel_port=b.side_channel_port,
            tp_size=b.tp_size, pp_size=b.pp_size, model=b.model,
            load=Load(running=load.running, waiting=load.waiting, free_blocks=load.free_blocks),
            seed=b.seed, mode=b.mode, authenticated=b.authenticated, compat=b.compat,
            kv_tokens=b.kv_blocks * b.block_size,
        )  # fmt: skip


def split_fragment(url: str) -> tuple[str, str]:
    """``http://host:port#fragment`` -> (``http://host:port``, ``fragment``)."""
    base, _, fragment = url.partition("#")
    return base, fragment
