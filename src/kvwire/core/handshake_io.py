"""What goes into the handshake core and what comes out (``kvwire.core.handshake``): the inputs a driver
feeds it (a caller's round, a fetch's or a load's end, forget, reap) and the actions it answers (answer
the caller, start or join a flight, fetch, sleep, load, unload). Exceptions travel as values. Frozen
``msgspec.Struct``s, as in ``kvwire.core.io`` (cheaper to build than frozen dataclasses)."""

from __future__ import annotations

import enum

import msgspec

from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import KvwireError
from kvwire.protocol.types import PeerMode


class FailureReason(enum.Enum):
    """Why a handshake failed (a label of the failure counter)."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    INCOMPATIBLE = "incompatible"
    REPLACED = "replaced"  # another engine answers at the address than the one named
    UNAUTHORIZED = "unauthorized"
    NO_SUCH_RANK = "no_such_rank"
    BAD_REPLY = "bad_reply"
    TRANSPORT = "transport"


# --- inputs -------------------------------------------------------------------------------------------


class Lookup(msgspec.Struct, frozen=True):
    """What the cache answers at once for ``addr`` in ``mode`` (a hit is counted). ``dial``: the caller
    will handshake on a miss, so an address not allowed is refused here."""

    addr: PeerAddress
    mode: PeerMode
    engine_id: str | None = None
    incarnation: str | None = None
    dial: bool = False


class Want(msgspec.Struct, frozen=True):
    """One round of a caller that needs ``addr`` loaded in ``mode``; ``joined``: it already waited on a
    handshake (not counted as deduplicated again)."""

    addr: PeerAddress
    mode: PeerMode
    engine_id: str | None = None
    incarnation: str | None = None
    joined: bool = False


class Answered(msgspec.Struct, frozen=True):
    """The handshake a caller waited on loaded ``peer``: the peer's incarnation wins over the caller's."""

    mode: PeerMode
    engine_id: str | None
    peer: PeerRank


class Attempt(msgspec.Struct, frozen=True):
    """The flight of ``addr`` may try (again) now."""

    addr: PeerAddress


class FetchOk(msgspec.Struct, frozen=True):
    """The peer at ``addr`` answered as ``engine_id``/``incarnation``."""

    addr: PeerAddress
    engine_id: str
    incarnation: str


class FetchErr(msgspec.Struct, frozen=True):
    """One fetch attempt failed with ``error``; ``jitter`` in [0.5, 1] (the driver's randomness)."""

    addr: PeerAddress
    error: BaseException
    jitter: float = 1.0


class LoadOk(msgspec.Struct, frozen=True):
    """The peer's agent is loaded and its layout checked: ``peer`` as the fetch measured it."""

    addr: PeerAddress
    peer: PeerRank


class Failed(msgspec.Struct, frozen=True):
    """The flight of ``addr`` failed (or was cancelled) outside a fetch attempt."""

    addr: PeerAddress
    error: BaseException


class Forget(msgspec.Struct, frozen=True):
    """The peer engine (only that life with ``incarnation``) is dead or gone."""

    engine_id: str
    incarnation: str | None = None


class ForgetAgent(msgspec.Struct, frozen=True):
    """The process of the remote agent ``agent_name`` is gone (a send found it disconnected)."""

    agent_name: str


class Touch(msgspec.Struct, frozen=True):
    """The peer engine is in use."""

    engine_id: str


class Reap(msgspec.Struct, frozen=True):
    """Peers ``in_use`` are live; unload the ones idle past ``ttl_s``."""

    in_use: frozenset[str]
    ttl_s: float


class Close(msgspec.Struct, frozen=True):
    """Unload everything (handshakes in flight were cancelled first)."""


HsInput = (
    Lookup
    | Want
    | Answered
    | Attempt
    | FetchOk
    | FetchErr
    | LoadOk
    | Failed
    | Forget
    | ForgetAgent
    | Touch
    | Reap
    | Close
)

# --- actions ------------------------------------------------------------------------------------------


class Ready(msgspec.Struct, frozen=True):
    """Answer the caller: ``peer``."""

    peer: PeerRank


class Refuse(msgspec.Struct, frozen=True):
    """Answer the caller with ``error`` (not allowed, circuit open, another engine, not loaded)."""

    error: KvwireError


class Start(msgspec.Struct, frozen=True):
    """Start the flight of ``addr`` (then feed ``Attempt``); the caller waits on it."""

    addr: PeerAddress


class Join(msgspec.Struct, frozen=True):
    """The caller waits on the flight of ``addr`` already running."""

    addr: PeerAddress


class Fetch(msgspec.Struct, frozen=True):
    """One attempt at ``addr``'s metadata within ``timeout_s`` (``samples`` clock samples)."""

    addr: PeerAddress
    notif_only: bool
    samples: int
    timeout_s: float
    attempt: int


class Sleep(msgspec.Struct, frozen=True):
    """Wait ``seconds``, then feed ``Attempt``."""

    addr: PeerAddress
    seconds: float


class Load(msgspec.Struct, frozen=True):
    """Load the fetched agent within ``timeout_s``; check its layout unless ``mode`` is NOTIF_ONLY."""

    addr: PeerAddress
    mode: PeerMode
    timeout_s: float


class Unload(msgspec.Struct, frozen=True):
    """Remove the remote agent ``agent_name`` from the local agent."""

    agent_name: str


class Loaded(msgspec.Struct, frozen=True):
    """The flight ended: ``peer`` is cached (``upgrade``: NOTIF_ONLY -> FULL)."""

    addr: PeerAddress
    peer: PeerRank
    upgrade: bool


class Fail(msgspec.Struct, frozen=True):
    """The flight ended with ``error`` (``reason``: counted as such; None: cancelled or not ours)."""

    addr: PeerAddress
    mode: PeerMode
    error: BaseException
    reason: FailureReason | None


class Reaped(msgspec.Struct, frozen=True):
    """``engine_id`` was idle past the TTL and is unloaded."""

    engine_id: str


class Forgot(msgspec.Struct, frozen=True):
    """``ForgetAgent`` found the agent's engine life and forgot it (tell the other ranks)."""

    engine_id: str
    incarnation: str


HsAction = Ready | Refuse | Start | Join | Fetch | Sleep | Load | Unload | Loaded | Fail | Reaped | Forgot
# What a caller or a flight waits for: every action but ``Unload``, which a driver runs at once.
HsStep = Ready | Refuse | Start | Join | Fetch | Sleep | Load | Loaded | Fail | Reaped | Forgot
ENSURE_ROUNDS = 4  # a caller waits on at most: a notif-only in flight, an upgrade, a re-handshake
