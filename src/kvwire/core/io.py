"""What goes into a core and what comes out: inputs (things that happened) and actions (things to do).

A core is driven as ``actions = core.handle(now, input)``. The driver (threads, sockets, NIXL; or the
simulator) executes the actions in order. The contract a driver keeps:

* ``now`` never goes backwards, and is the same clock for every input of one core.
* An action with a non-zero ``token`` (``Send`` that needs an answer, ``PostWrite``/``PostRead``) gets its
  ``Outcome`` (a ``Digest``: its ``Digested``) fed back before any other input: the driver queues the
  outcomes of a batch and handles them right after it. Cores rely on this: between the action and its
  outcome nothing else happens.
* Every ``PostWrite``/``PostRead`` that was posted ends with exactly one ``XferEnded`` (the driver polls
  the transfer) unless the core released it first (``Release``); after ``Release`` none comes.
* ``StartHandshake`` ends with exactly one ``HandshakeDone`` (success or error), never re-entrantly: a
  cached peer's may come right after the input that asked (as an outcome does), one that needs a handshake
  when it ends, with other inputs between.
* ``SendClaim`` ends with exactly one ``ClaimAnswered``, never re-entrantly. A ``ClaimArrived`` is answered
  by exactly one ``AnswerClaim`` among its actions.
* ``Tick`` is due at ``core.wake_at()`` at the latest; earlier ticks are harmless.

Inputs and actions are frozen ``msgspec.Struct``s, not frozen dataclasses: a request makes about 30 of
them, and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (0.6 us for
three fields against msgspec's 0.08). Copy one with ``msgspec.structs.replace``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from kvwire.core.types import PeerRank
from kvwire.kv.digest import DigestScope
from kvwire.protocol.messages import Claim, ErrorCode, Failed, FailReason, Notification
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.types import PeerMode

# --- inputs -------------------------------------------------------------------------------------------


class Tick(msgspec.Struct, frozen=True):
    """Time passed: check fences, leases, liveness, heartbeats, tombstones (and, on P, pauses)."""


class NotifIn(msgspec.Struct, frozen=True):
    """A raw notification the transport delivered to local rank ``key`` from agent ``sender``."""

    key: RankKey
    sender: str
    raw: bytes


class XferEnded(msgspec.Struct, frozen=True):
    """A posted transfer is no longer in progress (``ok``: every byte landed)."""

    token: int
    ok: bool
    detail: str = ""


class HandshakeDone(msgspec.Struct, frozen=True):
    """A ``StartHandshake`` ended: ``peer`` on success, else ``error`` says why."""

    token: int
    peer: PeerRank | None
    error: str = ""
    # Why it failed, as the request's reason: incompatible and unauthorized are permanent (a client must
    # not retry them), another engine at the address than the one named is peer_dead (``PeerReplaced``:
    # it restarted), anything else is handshake_failed.
    reason: FailReason = FailReason.HANDSHAKE_FAILED
    # The connection was refused: no process listens at that address (a killed peer's is closed).
    nobody_listens: bool = False
    # ``peer`` came from the local rank's cache, not from the address now: no news of who holds it (one
    # rank's cache may still name an older life after another rank loaded the new one).
    cached: bool = False


class Outcome(msgspec.Struct, frozen=True):
    """Whether a tokened ``Send``/``Post*`` was accepted by the transport (see the module's contract)."""

    token: int
    ok: bool
    detail: str = ""


class Finished(msgspec.Struct, frozen=True):
    """P: prefill of ``transfer_id`` is over; the connector holds ``block_ids`` (same on every rank)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


class LayersReady(msgspec.Struct, frozen=True):
    """P, layer-wise push: the KV of ``layers`` (the model's layer indices) is final in ``block_ids`` for
    ``num_tokens`` tokens (the prefill's last step computed them). The engine keeps the blocks until its
    ``Finished`` (then the connector holds them) or ``Abort``."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    layers: tuple[int, ...]


class StepEnded(msgspec.Struct, frozen=True):
    """P, layer-wise push: the engine step that computed ``transfer_id``'s layers is over, so its blocks are
    protected again only by ``Finished``: no write of them starts before it (one still in flight now is
    released: the engine waited for them first, so that is a timeout)."""

    transfer_id: str


class Abort(msgspec.Struct, frozen=True):
    """The engine drops the request."""

    transfer_id: str


class RemoteEngine(msgspec.Struct, frozen=True):
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
    # The P life that prefilled (kv_transfer_params' remote_incarnation; None: not checked). Another life
    # at that address holds none of this request's KV: D fails the request rather than read its blocks.
    incarnation: str | None = None
    # P's ranks on several hosts (multi-node PP: kv_transfer_params' remote_hosts): rank (pp, tp) at
    # ``hosts[pp * tp_size + tp]``. Empty: every rank at ``host``.
    hosts: tuple[str, ...] = ()

    def port_of(self, rank: tuple[int, int]) -> int:
        """The side-channel port that serves P rank (pp, tp)."""
        return self.port + rank[0] * self.tp_size + rank[1] if self.rank_ports else self.port

    def host_of(self, rank: tuple[int, int]) -> str:
        """The host of P rank (pp, tp)'s side channel."""
        return self.hosts[rank[0] * self.tp_size + rank[1]] if self.hosts else self.host


class Decline(msgspec.Struct, frozen=True):
    """D: the engine will not load ``transfer_id`` from ``remote`` (it dropped the request before
    allocating its blocks, or its local prefix hit covers the prompt). D tells the P ranks, so P frees the
    prompt's blocks now rather than at its lease."""

    transfer_id: str
    remote: RemoteEngine


class Allocated(msgspec.Struct, frozen=True):
    """D: the request's blocks are allocated (token order, prefix-hit blocks included)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int
    remote: RemoteEngine


class Digested(msgspec.Struct, frozen=True):
    """The answer to a ``Digest``: the digest, or None when the memory cannot be read (device memory)."""

    token: int
    digest: bytes | None


class ClaimAnswered(msgspec.Struct, frozen=True):
    """D: P's answer to a ``SendClaim``: ``lease_s`` when granted (P holds the blocks at least that long
    from when it answered), else why not (``refusal``; ``detail`` for the log)."""

    token: int
    lease_s: float | None
    refusal: FailReason | None = None
    detail: str = ""


class ClaimArrived(msgspec.Struct, frozen=True):
    """P: an authenticated ``claim`` on its side channel (pull mode), to be answered at once."""

    token: int
    msg: Claim


Input = (
    Tick
    | NotifIn
    | XferEnded
    | HandshakeDone
    | Outcome
    | Finished
    | LayersReady
    | StepEnded
    | Abort
    | Decline
    | Allocated
    | Digested
    | ClaimAnswered
    | ClaimArrived
)

# --- actions ------------------------------------------------------------------------------------------


class Send(msgspec.Struct, frozen=True):
    """Send ``msg`` from local rank ``key`` to agent ``peer``; ``token`` != 0: feed back an ``Outcome``."""

    key: RankKey
    peer: str
    msg: Notification
    token: int = 0


class PostWrite(msgspec.Struct, frozen=True):
    """Post one WRITE of ``src`` (local) to ``dst`` (peer's) ``[n, 3]`` descriptor arrays; ``notif`` goes
    with its last byte (None: a layer-wise write that carries none). Feed back an ``Outcome``; later an
    ``XferEnded`` (unless released first)."""

    token: int
    key: RankKey
    peer: str
    src: np.ndarray
    dst: np.ndarray
    notif: bytes | None
    nbytes: int
    transfer_id: str = ""  # for logs and checks: whose blocks the bytes are for


class PostRead(msgspec.Struct, frozen=True):
    """Post one READ of the peer's ``src`` into local ``dst``; as ``PostWrite``, without a notification."""

    token: int
    key: RankKey
    peer: str
    src: np.ndarray
    dst: np.ndarray
    nbytes: int
    transfer_id: str = ""


class Digest(msgspec.Struct, frozen=True):
    """Compute ``kv.digest.kv_digest`` of local rank ``key``'s cache over ``scope``; feed back ``Digested``
    (like an ``Outcome``: before any other input)."""

    token: int
    key: RankKey
    scope: DigestScope


class Release(msgspec.Struct, frozen=True):
    """Release transfer ``token``'s handle (NIXL cancels it if still in progress); no ``XferEnded`` after."""

    token: int


class StartHandshake(msgspec.Struct, frozen=True):
    """Load the agent of ``(host, port)``'s rank ``remote`` on local rank ``key`` (``mode``); answer with
    ``HandshakeDone``. ``engine_id``/``incarnation``: refuse (or do not reuse) any other engine life."""

    token: int
    key: RankKey
    host: str
    port: int
    remote: RankKey
    mode: PeerMode
    engine_id: str | None = None
    incarnation: str | None = None


class ReportFailure(msgspec.Struct, frozen=True):
    """Tell the peer's side channel ``(host, port)`` (its rank ``remote``) that ``failed`` ended its
    registration, when no notification can: the handshake with it failed. Best effort, one attempt within
    the handshake timeout; nothing is fed back."""

    key: RankKey
    host: str
    port: int
    remote: RankKey
    failed: Failed
    remote_incarnation: str = ""  # the peer's life the registration came from (the report names it)


class ForgetPeer(msgspec.Struct, frozen=True):
    """Unload a peer engine's agents from every local rank (only that life when ``incarnation``)."""

    engine_id: str
    incarnation: str | None = None


class Reap(msgspec.Struct, frozen=True):
    """Peers ``in_use`` are live; unload the ones idle past ``engine_ttl_s``."""

    in_use: frozenset[str]


class TouchPeer(msgspec.Struct, frozen=True):
    """The peer engine spoke: it is not idle."""

    engine_id: str


class Emit(msgspec.Struct, frozen=True):
    """Report ``event`` to the engine (``poll()``)."""

    event: object


class SendClaim(msgspec.Struct, frozen=True):
    """D: ask P's rank ``remote`` at ``host:port`` (side channel) whether it still holds ``claim``'s blocks
    (pull mode, before any READ of them); its ``ClaimAnswered`` comes back."""

    token: int
    key: RankKey
    host: str
    port: int
    remote: RankKey
    claim: Claim


class AnswerClaim(msgspec.Struct, frozen=True):
    """P: the answer to ``ClaimArrived`` ``token``: granted for ``lease_s``, or refused (``code``)."""

    token: int
    lease_s: float | None
    code: ErrorCode | None = None
    detail: str = ""


Action = (
    Send
    | PostWrite
    | PostRead
    | Digest
    | Release
    | StartHandshake
    | ReportFailure
    | ForgetPeer
    | Reap
    | TouchPeer
    | Emit
    | SendClaim
    | AnswerClaim
)
Actions = Sequence[Action]
