"""The consumer's records: the P engine of a request, and per request its local parts and their links to
P ranks; the liveness of a P life. Plain data; the consumer core drives them."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

from kvwire.core.io import Allocated, RemoteEngine
from kvwire.core.types import EngineInfo, PeerRank
from kvwire.errors import BlockRangeError, LayoutError
from kvwire.kv.digest import common_layers, p_layers, pair_heads
from kvwire.kv.groups import grouped, moved_ids
from kvwire.kv.mapping import HeadSlice, RankLayout
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import FailReason
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ConsumerRequest

# (layers, (first head, count) per slice, slices) of one (P rank, local rank) pair (``PairMemo``).
Pair = tuple[range, tuple[tuple[int, int], ...], tuple[HeadSlice, ...]]


@dataclass(eq=False)
class Link:
    """One local rank's tie to one P rank for one request."""

    src: RankKey
    peer: PeerRank | None = None
    registered_at: float = math.inf
    listed_at: float = 0.0  # push: the last heartbeat of this P rank that named the registration
    cancel_sent: bool = False
    dead_at: float | None = None
    token: int = 0  # pull: the READ in flight (0: none)
    posting: bool = False  # pull: a PostRead awaits its Outcome
    sending: bool = False  # push: the push_reg Send awaits its Outcome
    posted_at: float = 0.0
    read_done: bool = False
    rehandshaked: bool = False  # a push_reg could not be sent: the handshake was redone once
    reg_nonce: int = 0  # push: the push_reg's, which P's done must echo
    want_digest: bool = False  # push: D asked P for a digest of what it writes
    # Pull: a ``claim`` is out (claiming), or P granted it (claimed: its word ends P's hold) until
    # ``claim_until`` (by this side's clock: the claim was sent before P answered, so P holds at least
    # that long); a read that ends later may have copied blocks P had freed.
    claiming: bool = False
    claimed: bool = False
    claim_until: float = math.inf


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
    # Until then the blocks stay held although every rank ended: P ended one with a write it had posted
    # (``consumer_liveness.drain_hold``).
    hold_until: float = 0.0


def wrong_peer(peer: PeerRank, remote: RemoteEngine) -> tuple[FailReason, str] | None:
    """Why the P rank a handshake loaded cannot serve the request (None: it can), and the reason to fail it.

    * Another life than the one that prefilled (``remote.incarnation``): P restarted since, and the new
      life's blocks hold none of this request's KV (pull would read them: the simulator found READY with
      other bytes after a P crash during a D freeze). ``peer_dead``.
    * Another tp or pp than the request says (the router's, e.g. a vLLM prefill URL's ``&tp=&pp=``): they
      decide what D expects of each P rank, so it would fail on its first ``done``, obscurely.
      ``incompatible``."""
    if remote.incarnation not in (None, peer.incarnation):
        return FailReason.PEER_DEAD, (
            f"P {peer.engine_id} is now life {peer.incarnation}, not {remote.incarnation} that prefilled: it "
            "restarted since, and holds none of this request's KV"
        )
    if (peer.tp_size, peer.pp_size) == (remote.tp_size, remote.pp_size):
        return None
    return FailReason.INCOMPATIBLE, (
        f"P {peer.engine_id} is tp {peer.tp_size} pp {peer.pp_size}, the request says tp {remote.tp_size} "
        f"pp {remote.pp_size} (a vLLM prefill URL names them: #...&tp=N&pp=N)"
    )


@dataclass
class PeerLife:
    last_seen: float  # any sign of life: a notification or a handshake answer
    dead_at: float | None = None
    gone: bool = False  # another life answered at its address (not from a cache): this process is over
    # Each death verdict's time (``dead_at`` goes back to None when a fresh handshake revives the life; the
    # links that got a verdict keep its time) -> the first word after it (a message, or another life
    # answering at its address; None until then). The word is the sign the writes are recalled, but
    # bytes the kernels held may drain for a grace after it. A few entries: one per verdict, dropped
    # past the quarantine.
    confirmed: dict[float, float | None] = field(default_factory=dict)
    # No registration with this life that may still be written is older (a lower bound: links that ended
    # leave it low until the next liveness pass that visits the life recomputes it).
    oldest_reg: float = math.inf
    verdicts: bool = False  # some link holds this life's death verdict: its word may end quarantines
    # The side-channel addresses its ranks answered at: another life answering at one ends this one.
    addresses: set[tuple[str, int]] = field(default_factory=set)


class UsedIds:
    """Transfer ids this D life has registered, the oldest forgotten past ``bound`` (a bounded table: a
    peer or client cannot grow it). Insertion-ordered dict as a FIFO set."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._ids: dict[str, None] = {}

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, transfer_id: str) -> bool:
        """Remember ``transfer_id``; False (nothing changed) when it is remembered already."""
        if transfer_id in self._ids:
            return False
        self._ids[transfer_id] = None
        if len(self._ids) > self._bound:
            del self._ids[next(iter(self._ids))]
        return True


def sampled(transfer_id: str, share: float) -> bool:
    """Whether ``transfer_id`` falls in the sampled ``share`` of requests (the same answer every time)."""
    if share >= 1.0:
        return True
    return share > 0.0 and zlib.crc32(transfer_id.encode()) < share * 2**32


def check_allocation(engine: EngineInfo, num_blocks: int, inp: Allocated) -> None:
    """The engine's ``request_allocated`` arguments, checked before anything is sent (raises)."""
    spec, tid = engine.spec, inp.transfer_id
    n, cached = inp.num_tokens, inp.num_cached_tokens
    ids = list(inp.block_ids)
    if grouped(spec) and 0 <= cached <= n:  # a hybrid model's: the blocks its groups' tokens occupy
        ids = moved_ids(spec, ids, n, cached)
    if any(not 0 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
        raise BlockRangeError(f"{tid}: local block ids out of range or repeated")
    if n <= 0 or not 0 <= cached <= n or cached % spec.block_size:
        raise LayoutError(f"{tid}: bad token counts {n}/{cached}")
    if len(inp.block_ids) * spec.block_size < n:
        raise BlockRangeError(f"{tid}: {len(ids)} blocks cannot hold {n} tokens")


class PairMemo:
    """What one P rank writes into one local rank, by geometry only (layers, head slices), memoized: the
    consumer asks it for every ``done``. Bounded: peers of every geometry may come."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[int, int, int, RankKey, RankKey], Pair] = {}

    def get(self, spec: KVSpec, sizes: tuple[int, int, int], src: RankKey, local: RankLayout) -> Pair:
        """``sizes``: P's TP size, P's PP size, this engine's TP size."""
        p_tp, p_pp, d_tp = sizes
        key = (p_tp, p_pp, d_tp, src, (local.pp_rank, local.tp_rank))
        pair = self._pairs.get(key)
        if pair is None:
            slices = pair_heads(spec, p_tp, d_tp, src[1], local.tp_rank)
            layers = common_layers(p_layers(spec, p_pp, src[0]), local.layers)
            if len(self._pairs) >= 256:
                self._pairs.clear()
            pair = self._pairs[key] = (layers, tuple((s.dst_head, s.num_heads) for s in slices), slices)
        return pair
