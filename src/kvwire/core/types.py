"""What the cores know of engines: this engine's identity and geometry, and a peer rank as loaded.

Plain values with no I/O (``kvwire.handshake.types`` re-exports them, where the handshake fills them in):
importing a core must not load the handshake's sockets and threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.kv.mapping import RankLayout
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.types import PeerMode


@dataclass(frozen=True)
class EngineInfo:
    """This engine: identity (the incarnation changes at every start) and the geometry peers must match."""

    engine_id: str
    incarnation: str
    model_id: str
    spec: KVSpec
    tp_size: int
    pp_size: int
    transfer_mode: TransferMode


@dataclass(frozen=True)
class PeerRank:
    """One remote (pp, tp) rank as loaded into ONE local agent.

    ``agent_name`` is the remote agent's name in the local agent (for ``send_notif`` and ``post``);
    ``layout`` is None when the peer is loaded notif-only (its memory is not addressable).
    ``clock_offset_s`` is the peer's clock minus ours, from the lowest-RTT sample.
    """

    engine_id: str
    incarnation: str
    host: str
    port: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    agent_name: str
    mode: PeerMode
    layout: RankLayout | None
    num_blocks: int
    clock_offset_s: float


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Cache key of a handshake: where the peer's side channel is and which of its ranks we load."""

    host: str
    port: int
    pp_rank: int
    tp_rank: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/pp{self.pp_rank}/tp{self.tp_rank}"
