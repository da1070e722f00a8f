"""What every core shares: the action buffer, tokens, notification intake, timer cadence, counters.

A core never reads a clock, never sleeps, never touches an agent or a socket: it is handed ``now`` with
each input and answers with actions (``kvwire.core.io``). Rules that need time (fences, leases, liveness,
grace, tombstones, heartbeats, transfer timeouts) compare the ``now`` they are given with deadlines they
stored, and ``wake_at`` says when the next one may fire. So the same object runs under the threaded
driver (``kvwire.connector``) and under the simulator (``kvwire.testing.sim``) in virtual time.

Input that does not fit (a peer's late or stray message, an engine call twice) raises ``Refused`` before
touching any state: the driver counts it by reason and goes on. What the gap before it already decided
(a freeze noticed on that input: writes recalled, D told, blocks freed) is not the input's to lose: the
driver executes ``salvage()`` first.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvwire.core.config import ConnectorConfig
from kvwire.core.events import ConnectorStats
from kvwire.core.io import Action, Emit, Input, NotifIn, Send, Tick
from kvwire.core.types import EngineInfo
from kvwire.errors import ProtocolError
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.codec import decode_notif
from kvwire.protocol.messages import Notification
from kvwire.protocol.ranks import RankKey

if TYPE_CHECKING:
    import logging


def core_log() -> logging.Logger:
    """The cores' logger. ``logging`` is imported at the first line logged, not with the core: it loads
    ``threading``, and a core imports without I/O or threads (``tests/unit/test_core_imports.py``)."""
    import logging

    return logging.getLogger("kvwire.connector")


# How often the timers (fences, leases, liveness) are checked while something is live: their bounds are
# seconds, so 20 ms of lateness is noise, and each check walks the live requests (checking at every
# 0.5 ms tick would cost per tick; found by the simulator, where timers dominated long faulty runs).
TIMER_PERIOD_S = 0.02


class DropReason(enum.Enum):
    """Why a peer's notification was dropped (``kvwire_dropped_notifications{reason}``)."""

    MALFORMED = "malformed"
    WRONG_SENDER = "wrong_sender"
    STALE_INCARNATION = "stale_incarnation"
    UNEXPECTED = "unexpected"
    UNKNOWN_TRANSFER = "unknown_transfer"
    # D: for a transfer this life registered and ended (late, or replayed): it completes nothing.
    ENDED_TRANSFER = "ended_transfer"
    DUPLICATE = "duplicate"
    LATE = "late"
    OVERLOAD = "overload"
    CANCELLED = "cancelled"
    # Dropped by the driver before the core: not sealed by a holder of the shared secret for this receiver
    # (or sealed while this side has no secret).
    UNAUTHENTICATED = "unauthenticated"


class Refused(ProtocolError):
    """An input the core cannot take in its current state; nothing was changed."""

    def __init__(self, role: str, reason: DropReason, detail: str) -> None:
        super().__init__(f"{role}: {reason.value}: {detail}")
        self.role = role
        self.reason = reason
        self.detail = detail


def sender_matches(sender: str, engine_id: str, incarnation: str) -> bool:
    """Whether a NIXL sender name belongs to the engine life a message claims (``make_agent_name``)."""
    return sender.startswith(f"{engine_id}/{incarnation}/")


class Feeder:
    """Feeds one core under the driver contract of ``kvwire.core.io``: the inputs that executing an action
    calls for (an ``Outcome``, handed to ``follow``) are handled right after the current input, before any
    other. The one implementation of that queue, for the threaded driver, the simulator and the tests.

    ``execute`` runs one action; ``failed(input, exc)`` hears what the core raised for an input (or an
    action of it raised): count a ``Refused``, log the rest; if ``failed`` raises, what was queued is
    dropped and the exception goes to ``feed``'s caller."""

    def __init__(
        self,
        core: CoreBase,
        execute: Callable[[Action], None],
        failed: Callable[[Input, Exception], None],
    ) -> None:
        self.core = core
        self._execute = execute
        self._failed = failed
        self._pending: collections.deque[Input] = collections.deque()

    def follow(self, inp: Input) -> None:
        """Queue ``inp`` (an action's ``Outcome``) to be handled before any input fed later."""
        self._pending.append(inp)

    def feed(self, now: float, inp: Input) -> None:
        pending = self._pending
        pending.append(inp)
        if len(pending) > 1:
            return  # re-entered from an action: the outer call drains the queue
        try:
            while pending:
                item = pending[0]
                try:
                    for action in self.core.handle(now, item):
                        self._execute(action)
                except Exception as exc:
                    for action in self.core.salvage():
                        self._execute(action)
                    self._failed(item, exc)
                finally:
                    pending.popleft()
        except BaseException:
            pending.clear()
            raise


class CoreBase:
    """Shared machinery of ``ProducerCore`` and ``ConsumerCore``."""

    role = "core"

    def __init__(
        self,
        engine: EngineInfo,
        layouts: Mapping[RankKey, RankLayout],
        num_blocks: int,
        config: ConnectorConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.config = config
        self.layouts = dict(layouts)
        self.num_blocks = num_blocks  # the smallest local rank's block count: ids must fit every rank
        self.host = host  # the side channel peers dial back (a push_reg names it)
        self.port = port
        self.stats = ConnectorStats()
        self._out: list[Action] = []
        self._salvaged: list[Action] = []
        self._token = 0
        self._next_timers = 0.0
        self._next_heartbeat = 0.0
        self._now = 0.0

    @property
    def keys(self) -> list[RankKey]:
        return list(self.layouts)

    # -- driving -------------------------------------------------------------------------------------------
    def handle(self, now: float, inp: Input) -> list[Action]:
        """Apply one input at time ``now``; the actions to execute, in order (raises ``Refused``)."""
        self._out = []
        self._now = now
        try:
            self._before(now, inp)
            kept = len(self._out)
            try:
                if isinstance(inp, Tick):
                    self._on_tick(now)
                elif isinstance(inp, NotifIn):
                    self._on_notif(now, inp.key, inp.sender, self._decode(inp))
                else:
                    self._on_input(now, inp)
            except Exception:
                self._salvaged = self._out[:kept]  # the gap's, not the input's: ``salvage``
                raise
        finally:
            out, self._out = self._out, []
        return out

    def salvage(self) -> list[Action]:
        """After ``handle`` raised: the actions the time before the input decided (a freeze noticed on it
        recalls writes and frees blocks), which the driver must still execute: a malformed notification
        that revealed a freeze lost them (the recalled write never released, its request's blocks never
        freed; found by a review, the simulator ticks first after a thaw)."""
        out, self._salvaged = self._salvaged, []
        return out

    @property
    def live(self) -> bool:
        """Something a timer may act on soon: a live request (not only tombstones)."""
        return self._live()

    def wake_at(self) -> float:
        """The latest time the next ``Tick`` is due. Never more than a heartbeat period ahead: a core
        tells a freeze from idleness by the gap between its inputs (``PushProducerCore``), so a driver
        that follows ``wake_at`` never leaves it without input longer than that."""
        due = self._next_timers if self._live() else self._idle_deadline()
        return min(due, self._now + self.config.heartbeat_interval_s)

    def _on_tick(self, now: float) -> None:
        if now >= self._next_timers:
            self._next_timers = now + TIMER_PERIOD_S
            self._timers(now)

    def _decode(self, inp: NotifIn) -> Notification:
        try:
            msg = decode_notif(inp.raw)
        except ProtocolError as exc:
            raise Refused(self.role, DropReason.MALFORMED, f"from {inp.sender}: {exc}") from None
        if not sender_matches(inp.sender, msg.engine_id, msg.incarnation):
            raise Refused(
                self.role,
                DropReason.WRONG_SENDER,
                f"{type(msg).__name__} claims {msg.engine_id}/{msg.incarnation}, sent by {inp.sender}",
            )
        return msg

    # -- helpers for subclasses -----------------------------------------------------------------------------
    def _new_token(self) -> int:
        self._token += 1
        return self._token

    def _do(self, action: Action) -> None:
        self._out.append(action)

    def _send(self, key: RankKey, peer: str, msg: Notification, *, answer: bool = False) -> int:
        token = self._new_token() if answer else 0
        self._out.append(Send(key, peer, msg, token))
        return token

    def _emit(self, event: object) -> None:
        self._out.append(Emit(event))

    def _refuse(self, reason: DropReason, detail: str) -> Refused:
        return Refused(self.role, reason, detail)

    def _log_info(self, fmt: str, *args: object) -> None:
        core_log().info("%s: " + fmt, self.role, *args)

    def _log_warning(self, fmt: str, *args: object) -> None:
        core_log().warning("%s: " + fmt, self.role, *args)

    def _heartbeat_due(self, now: float) -> bool:
        if now < self._next_heartbeat:
            return False
        self._next_heartbeat = now + self.config.heartbeat_interval_s
        return True

    # -- hooks ---------------------------------------------------------------------------------------------
    def _before(self, now: float, inp: Input) -> None:
        """Runs before every input (P: notices a freeze before anything else happens)."""

    def _live(self) -> bool:
        """Anything that a timer may act on (a live request, a tombstone)."""
        return False

    def _idle_deadline(self) -> float:
        return math.inf

    def _on_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        raise NotImplementedError

    def _on_input(self, now: float, inp: Input) -> None:
        raise NotImplementedError

    def _timers(self, now: float) -> None:
        pass

    @property
    def busy(self) -> bool:
        """A transfer is in flight: the driver should poll at its fast rate."""
        return False

    def shutdown(self, now: float) -> list[Action]:
        """The engine is closing: tell peers what ends here and report what the engine must free."""
        self._out = []
        self._on_shutdown(now)
        out, self._out = self._out, []
        return out

    def _on_shutdown(self, now: float) -> None:
        pass
