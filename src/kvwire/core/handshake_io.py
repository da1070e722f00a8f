"""What goes into the handshake core and what comes out (``kvwire.core.handshake``): the inputs a driver
feeds it (a caller's round, a fetch's or a load's end, forget, reap) and the actions it answers (answer
the caller, start or join a flight, fetch, sleep, load, unload). Exceptions travel as values."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import KvwireError
from kvwire.protocol.types import PeerMode


class FailureReason(enum.Enum):
    """Why a handshake failed (a label of the failure counter)."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    INCOMPATIBLE = "incompatible"
    UNAUTHORIZED = "unauthorized"
    NO_SUCH_RANK = "no_such_rank"
    BAD_REPLY = "bad_reply"
    TRANSPORT = "transport"


# --- inputs -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the cache answers at once for ``addr`` in ``mode`` (a hit is counted). ``dial``: the caller
    will handshake on a miss, so an address not allowed is refused here."""

    addr: PeerAddress
    mode: PeerMode
    engine_id: str | None = None
    incarnation: str | None = None
    dial: bool = False


@dataclass(frozen=True, slots=True)
class Want:
    """One round of a caller that needs ``addr`` loaded in ``mode``; ``joined``: it already waited on a
    handshake (not counted as deduplicated again)."""

    addr: PeerAddress
    mode: PeerMode
    engine_id: str | None = None
    incarnation: str | None = None
    joined: bool = False


@dataclass(frozen=True, slots=True)
class Answered:
    """The handshake a caller waited on loaded ``peer``: the peer's incarnation wins over the caller's."""

    mode: PeerMode
    engine_id: str | None
    peer: PeerRank


@dataclass(frozen=True, slots=True)
class Attempt:
    """The flight of ``addr`` may try (again) now."""

    addr: PeerAddress


@dataclass(frozen=True, slots=True)
class FetchOk:
    """The peer at ``addr`` answered as ``engine_id``/``incarnation``."""

    addr: PeerAddress
    engine_id: str
    incarnation: str


@dataclass(frozen=True, slots=True)
class FetchErr:
    """One fetch attempt failed with ``error``; ``jitter`` in [0.5, 1] (the driver's randomness)."""

    addr: PeerAddress
    error: BaseException
    jitter: float = 1.0


@dataclass(frozen=True, slots=True)
class LoadOk:
    """The peer's agent is loaded and its layout checked: ``peer`` as the fetch measured it."""

    addr: PeerAddress
    peer: PeerRank


@dataclass(frozen=True, slots=True)
class Failed:
    """The flight of ``addr`` failed (or was cancelled) outside a fetch attempt."""

    addr: PeerAddress
    error: BaseException


@dataclass(frozen=True, slots=True)
class Forget:
    """The peer engine (only that life with ``incarnation``) is dead or gone."""

    engine_id: str
    incarnation: str | None = None


@dataclass(frozen=True, slots=True)
class ForgetAgent:
    """The process of the remote agent ``agent_name`` is gone (a send found it disconnected)."""

    agent_name: str


@dataclass(frozen=True, slots=True)
class Touch:
    """The peer engine is in use."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class Reap:
    """Peers ``in_use`` are live; unload the ones idle past ``ttl_s``."""

    in_use: frozenset[str]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Close:
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


@dataclass(frozen=True, slots=True)
class Ready:
    """Answer the caller: ``peer``."""

    peer: PeerRank


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the caller with ``error`` (not allowed, circuit open, another engine, not loaded)."""

    error: KvwireError


@dataclass(frozen=True, slots=True)
class Start:
    """Start the flight of ``addr`` (then feed ``Attempt``); the caller waits on it."""

    addr: PeerAddress


@dataclass(frozen=True, slots=True)
class Join:
    """The caller waits on the flight of ``addr`` already running."""

    addr: PeerAddress


@dataclass(frozen=True, slots=True)
class Fetch:
    """One attempt at ``addr``'s metadata within ``timeout_s`` (``samples`` clock samples)."""

    addr: PeerAddress
    notif_only: bool
    samples: int
    timeout_s: float
    attempt: int


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``, then feed ``Attempt``."""

    addr: PeerAddress
    seconds: float


@dataclass(frozen=True, slots=True)
class Load:
    """Load the fetched agent within ``timeout_s``; check its layout unless ``mode`` is NOTIF_ONLY."""

    addr: PeerAddress
    mode: PeerMode
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Unload:
    """Remove the remote agent ``agent_name`` from the local agent."""

    agent_name: str


@dataclass(frozen=True, slots=True)
class Loaded:
    """The flight ended: ``peer`` is cached (``upgrade``: NOTIF_ONLY -> FULL)."""

    addr: PeerAddress
    peer: PeerRank
    upgrade: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """The flight ended with ``error`` (``reason``: counted as such; None: cancelled or not ours)."""

    addr: PeerAddress
    mode: PeerMode
    error: BaseException
    reason: FailureReason | None


@dataclass(frozen=True, slots=True)
class Reaped:
    """``engine_id`` was idle past the TTL and is unloaded."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class Forgot:
    """``ForgetAgent`` found the agent's engine life and forgot it (tell the other ranks)."""

    engine_id: str
    incarnation: str


HsAction = Ready | Refuse | Start | Join | Fetch | Sleep | Load | Unload | Loaded | Fail | Reaped | Forgot
# What a caller or a flight waits for: every action but ``Unload``, which a driver runs at once.
HsStep = Ready | Refuse | Start | Join | Fetch | Sleep | Load | Loaded | Fail | Reaped | Forgot
ENSURE_ROUNDS = 4  # a caller waits on at most: a notif-only in flight, an upgrade, a re-handshake
