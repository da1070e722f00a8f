"""The consumer's records: the P engine of a request, and per request its local parts and their links to
P ranks; the liveness of a P life. Plain data; ``consumer.py`` drives them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvwire.connector._base import RankKey
from kvwire.handshake.types import PeerRank
from kvwire.protocol.messages import FailReason
from kvwire.protocol.states import ConsumerRequest
from kvwire.transport.base import XferHandle


@dataclass(frozen=True, slots=True)
class RemoteEngine:
    """The P engine of a request (the decode leg's ``kv_transfer_params``)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1
    block_ids: tuple[int, ...] = ()  # pull only: P's blocks for the request, in token order
    # One side channel per P rank (one process per rank, as vLLM runs): rank (pp, tp) listens at
    # ``port + pp * tp_size + tp``. False: one listener serves every rank (kvwire's own engine).
    rank_ports: bool = False

    def port_of(self, rank: tuple[int, int]) -> int:
        """The side-channel port that serves P rank (pp, tp)."""
        return self.port + rank[0] * self.tp_size + rank[1] if self.rank_ports else self.port


@dataclass(eq=False)
class Link:
    """One local rank's tie to one P rank for one request."""

    src: RankKey
    peer: PeerRank | None = None
    registered_at: float = math.inf
    cancel_sent: bool = False
    dead_at: float | None = None
    handle: XferHandle | None = None  # pull: the READ in flight
    posted_at: float = 0.0
    read_done: bool = False
    rehandshaked: bool = False  # a push_reg could not be sent: the handshake was redone once


@dataclass(eq=False)
class LocalPart:
    key: RankKey
    machine: ConsumerRequest
    links: dict[RankKey, Link]


@dataclass(eq=False)
class Request:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int
    remote: RemoteEngine
    parts: dict[RankKey, LocalPart] = field(default_factory=dict)
    reason: FailReason | None = None  # first failure seen
    reported_failed: bool = False
    aborted: bool = False


@dataclass
class PeerLife:
    last_seen: float
    dead_at: float | None = None
