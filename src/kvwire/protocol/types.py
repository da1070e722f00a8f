"""Plain values shared by every layer: memory kinds, byte ranges, how a peer is loaded.

They are NIXL's vocabulary (``kvwire.transport.base`` re-exports them) but carry no I/O, so the sans-IO
cores and the KV layout code import them from here without loading a transport.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemKind(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class PeerMode(enum.Enum):
    """How a peer is loaded into an agent: notifications only, or its memory addressable too."""

    NOTIF_ONLY = "notif_only"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class Desc:
    """One contiguous byte range: address, length, device id (0 for DRAM)."""

    addr: int
    length: int
    device_id: int = 0
