"""The rules of P's ``report_failed`` deliveries as a sans-IO core: ``actions = core.handle(now, input)``.

When P's handshake with D fails, no notification can tell D that its registration failed: P reports it
on D's side channel instead (``kvwire.connector.reports``, the driver, does the connection). What this
core decides:

* an address not in ``allowed_peers`` is never dialled (a ``push_reg`` named it);
* no ``overloaded`` report without a shared secret: the ``push_reg`` P had no room for is then
  unauthenticated, and so is the address it names (a flood must not make P a connection reflector);
* one delivery at a time per address: a burst of failed registrations naming one address opens one
  connection at a time there, not one per registration;
* once a delivery is not answered, that address's queued reports are dropped, and so are new ones for
  ``backoff_s``: there is no one to tell;
* queues (``MAX_QUEUED_PER_ADDRESS``) and addresses (``MAX_ADDRESSES``) are bounded.

Every report not delivered is counted in ``drops[UNDELIVERED]`` (the connector's dropped-notification
counter, ``/metrics``). The driver's contract: each ``Deliver`` is answered with one ``Ended``.
"""

from __future__ import annotations

import collections
import enum
from collections import Counter
from dataclasses import dataclass
from typing import assert_never

from kvwire.core.io import ReportFailure
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.messages import FailReason

UNDELIVERED = "report_undelivered"
MAX_QUEUED_PER_ADDRESS = 256
MAX_ADDRESSES = 1024
DEFAULT_BACKOFF_S = 10.0

Address = tuple[str, int]


class Delivery(enum.Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"  # D answered and refused this report (another life, no such rank, ...)
    UNANSWERED = "unanswered"  # nobody answered: refused connection, reset, timeout


@dataclass(frozen=True, slots=True)
class Submit:
    """The protocol core asked for this report (``ReportFailure``)."""

    report: ReportFailure


@dataclass(frozen=True, slots=True)
class Ended:
    """The delivery of the report at the head of ``addr``'s queue ended ``how``."""

    addr: Address
    how: Delivery


ReportInput = Submit | Ended


@dataclass(frozen=True, slots=True)
class Deliver:
    """Make one attempt at delivering ``report`` to ``addr`` (then feed ``Ended``)."""

    addr: Address
    report: ReportFailure


ReportAction = Deliver


class ReportCore:
    """Which reports go, when, and which are dropped (see the module's docstring)."""

    def __init__(
        self,
        *,
        secret: bool,
        backoff_s: float = DEFAULT_BACKOFF_S,
        drops: Counter[str] | None = None,
        allowed: PeerAllowList | None = None,
    ) -> None:
        self._secret = secret
        self._backoff_s = backoff_s
        self.drops: Counter[str] = drops if drops is not None else Counter()
        self._allowed = allowed if allowed is not None else PeerAllowList()
        # Reports waiting behind the one being delivered, by address (an entry: a delivery is running).
        self.queues: dict[Address, collections.deque[ReportFailure]] = {}
        self.failed_at: dict[Address, float] = {}
        self.delivered = 0

    @property
    def dropped(self) -> int:
        return self.drops[UNDELIVERED]

    def handle(self, now: float, inp: ReportInput) -> list[ReportAction]:
        match inp:
            case Submit(report):
                return self._submit(now, report)
            case Ended(addr, how):
                return self._ended(now, addr, how)
            case _:
                assert_never(inp)

    def _drop(self, n: int = 1) -> list[ReportAction]:
        self.drops[UNDELIVERED] += n
        return []

    def _backing_off(self, now: float, addr: Address) -> bool:
        at = self.failed_at.get(addr)
        if at is None:
            return False
        if now - at < self._backoff_s:
            return True
        del self.failed_at[addr]
        return False

    def _submit(self, now: float, report: ReportFailure) -> list[ReportAction]:
        addr = (report.host, report.port)
        if not self._allowed.allows(report.host):  # a push_reg named it: never dialled
            return self._drop()
        if not self._secret and report.failed.reason is FailReason.OVERLOADED:
            return self._drop()
        if self._backing_off(now, addr):
            return self._drop()
        queue = self.queues.get(addr)
        if queue is not None:
            if len(queue) >= MAX_QUEUED_PER_ADDRESS:
                return self._drop()
            queue.append(report)
            return []
        if len(self.queues) >= MAX_ADDRESSES:
            return self._drop()
        self.queues[addr] = collections.deque()
        return [Deliver(addr, report)]

    def _ended(self, now: float, addr: Address, how: Delivery) -> list[ReportAction]:
        queue = self.queues[addr]
        if how is Delivery.DELIVERED:
            self.delivered += 1
        elif how is Delivery.REFUSED:
            self._drop()  # D answers: the next report may well be taken
        else:
            self._drop(1 + len(queue))
            queue.clear()
            if len(self.failed_at) >= MAX_ADDRESSES:
                del self.failed_at[next(iter(self.failed_at))]
            self.failed_at[addr] = now
        if queue:
            return [Deliver(addr, queue.popleft())]
        del self.queues[addr]
        return []

    def abandon(self, addr: Address) -> None:
        """The driver stopped delivering to ``addr`` (shutdown): its queue goes."""
        self.queues.pop(addr, None)
