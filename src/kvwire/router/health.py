"""What the router knows of one engine (``HealthInfo``), whatever kind of engine it is.

Each engine kind (``kvwire.router.dialects``) fills it its own way: kvwire's engines say all of it in their
``/health``; a vLLM engine's identity is in its configured URL's fragment or its discovery record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.protocol.messages import TransferMode
from kvwire.router.policy import Load


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
    kv_tokens: int = 0  # the KV cache's size in tokens, when the engine says (sizes the prefix index)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> HealthInfo:
        """Raises ``KeyError``, ``TypeError`` or ``ValueError`` on a body that does not follow the API."""
        load = body.get("load") or {}
        info = cls(
            role=str(body["role"]),
            engine_id=str(body["engine_id"]),
            incarnation=str(body.get("incarnation", "")),
            side_channel_host=str(body["side_channel_host"]),
            side_channel_port=int(body["side_channel_port"]),
            tp_size=int(body.get("tp_size", 1)),
            pp_size=int(body.get("pp_size", 1)),
            model=str(body.get("model", "")),
            load=Load(
                running=int(load.get("running", 0)),
                waiting=int(load.get("waiting", 0)),
                free_blocks=int(load.get("free_blocks", 0)),
            ),
            seed=int(body["seed"]) if body.get("seed") is not None else None,
            mode=TransferMode(body["mode"]) if body.get("mode") is not None else None,
            authenticated=bool(body["authenticated"]) if body.get("authenticated") is not None else None,
            kv_tokens=int(body.get("kv_blocks", 0)) * int(body.get("block_size", 0)),
        )
        if body.get("status", "ok") != "ok":
            raise ValueError(f"status {body.get('status')!r}")
        return info


def split_fragment(url: str) -> tuple[str, str]:
    """``http://host:port#fragment`` -> (``http://host:port``, ``fragment``)."""
    base, _, fragment = url.partition("#")
    return base, fragment
