"""The consumer's records: the P engine of a request, and per request its local parts and their links to
P ranks; the liveness of a P life. Plain data; the consumer core drives them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvwire.core.io import RemoteEngine
from kvwire.handshake.types import PeerRank
from kvwire.protocol.messages import FailReason
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ConsumerRequest


@dataclass(eq=False)
class Link:
    """One local rank's tie to one P rank for one request."""

    src: RankKey
    peer: PeerRank | None = None
    registered_at: float = math.inf
    cancel_sent: bool = False
    dead_at: float | None = None
    token: int = 0  # pull: the READ in flight (0: none)
    posting: bool = False  # pull: a PostRead awaits its Outcome
    sending: bool = False  # push: the push_reg Send awaits its Outcome
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
    last_seen: float  # any sign of life: a notification or a handshake answer
    dead_at: float | None = None
    # The last notification from this life: one after a link's verdict confirms the life recalled its
    # writes (a thawed P recalls before it sends anything), so that link's blocks leave quarantine.
    last_msg: float = -math.inf
    gone: bool = False  # a newer life of the engine answered: this process is over
