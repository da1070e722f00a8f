"""``report_failed``: P tells D that a registration failed when no notification can reach D.

P writes into D only after loading D's agent (its full handshake with D); when that handshake fails, P
cannot send D the ``failed`` notification, and D would wait for its liveness timeout to give up on P. The
report goes to D's side channel instead (the address D named in its ``push_reg``), signed like a metadata
request; D feeds it to its core exactly as the ``failed`` notification it stands for, from the P rank it
names, so the core's own checks (known transfer, that P life, that rank) apply unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable

from kvwire.core.io import NotifIn, ReportFailure
from kvwire.errors import HandshakeTimeout, KvwireError, PeerUnreachable
from kvwire.handshake.client import send_report
from kvwire.handshake.types import PeerAddress
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import Failed, FailReason, ReportFailed
from kvwire.transport.base import make_agent_name

log = logging.getLogger("kvwire.connector")

UNDELIVERED = "report_undelivered"
MAX_QUEUED_PER_ADDRESS = 256
MAX_ADDRESSES = 1024


def report_of(action: ReportFailure) -> ReportFailed:
    f = action.failed
    return ReportFailed(
        pp_rank=action.remote[0],
        tp_rank=action.remote[1],
        to_incarnation=action.remote_incarnation,
        transfer_id=f.transfer_id,
        engine_id=f.engine_id,
        incarnation=f.incarnation,
        from_pp_rank=f.pp_rank,
        from_tp_rank=f.tp_rank,
        reason=f.reason.value,
    )


class Delivery(enum.Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"  # D answered and refused this report (another life, no such rank, ...)
    UNANSWERED = "unanswered"  # nobody answered: refused connection, reset, timeout


async def deliver(action: ReportFailure, *, timeout_s: float, secret: bytes | None) -> Delivery:
    """One attempt within ``timeout_s``; how it ended (logged at DEBUG)."""
    addr = PeerAddress(action.host, action.port, action.remote[0], action.remote[1])
    tid = action.failed.transfer_id
    try:
        await send_report(addr, report_of(action), timeout_s=timeout_s, secret=secret)
    except (PeerUnreachable, HandshakeTimeout) as exc:  # NobodyListens is a PeerUnreachable
        log.debug("report_failed for %s to %s not answered: %s", tid, addr, exc)
        return Delivery.UNANSWERED
    except KvwireError as exc:
        log.debug("report_failed for %s to %s refused: %s", tid, addr, exc)
        return Delivery.REFUSED
    except Exception as exc:  # e.g. an address the OS refuses to dial: never kill the task silently
        log.debug("report_failed for %s to %s failed: %r", tid, addr, exc)
        return Delivery.UNANSWERED
    log.debug("report_failed for %s delivered to %s", tid, addr)
    return Delivery.DELIVERED


def as_notification(report: ReportFailed) -> NotifIn:
    """The ``failed`` notification a report stands for, as the core's input."""
    failed = Failed(
        transfer_id=report.transfer_id,
        engine_id=report.engine_id,
        incarnation=report.incarnation,
        tp_rank=report.from_tp_rank,
        pp_rank=report.from_pp_rank,
        reason=report.fail_reason,
    )
    sender = make_agent_name(report.engine_id, report.incarnation, report.from_pp_rank, report.from_tp_rank)
    return NotifIn((report.pp_rank, report.tp_rank), sender, encode_notif(failed))


class Reporter:
    """Delivers reports one at a time per address: a burst of failed registrations naming one address
    (a D whose handshake fails, or a flood naming a listener) opens one connection at a time there, not one
    per registration. Once a delivery fails (nobody answers), that address's queued reports are dropped,
    and so are new ones for ``backoff_s``: there is no one to tell, and a flood naming an address that
    refuses reports must not turn into a connection per message. Queues and addresses are bounded; drops
    are counted in ``dropped``."""

    def __init__(
        self,
        *,
        timeout_s: float,
        secret: bytes | None,
        backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        drops: Counter[str] | None = None,
    ) -> None:
        # ``drops``: the connector's dropped-notification counter (``/metrics``), where undelivered reports
        # are counted as ``report_undelivered``.
        self._drops: Counter[str] = drops if drops is not None else Counter()
        self._timeout_s = timeout_s
        self._secret = secret
        self._backoff_s = backoff_s
        self._clock = clock
        self._queues: dict[tuple[str, int], collections.deque[ReportFailure]] = {}
        self._failed_at: dict[tuple[str, int], float] = {}
        self.delivered = 0

    @property
    def dropped(self) -> int:
        return self._drops[UNDELIVERED]

    def _drop(self, n: int = 1) -> None:
        self._drops[UNDELIVERED] += n

    def _backing_off(self, addr: tuple[str, int]) -> bool:
        at = self._failed_at.get(addr)
        if at is None:
            return False
        if self._clock() - at < self._backoff_s:
            return True
        del self._failed_at[addr]
        return False

    def submit(self, action: ReportFailure) -> asyncio.Task[None] | None:
        """Queue ``action``; a new task when this address had none draining (the caller tracks it)."""
        addr = (action.host, action.port)
        if self._secret is None and action.failed.reason is FailReason.OVERLOADED:
            # Without a secret the push_reg P had no room for is unauthenticated, and so is the address it
            # names: P does not dial it (a flood must not make P a connection reflector).
            self._drop()
            return None
        if self._backing_off(addr):
            self._drop()
            return None
        queue = self._queues.get(addr)
        if queue is not None:
            if len(queue) >= MAX_QUEUED_PER_ADDRESS:
                self._drop()
            else:
                queue.append(action)
            return None
        if len(self._queues) >= MAX_ADDRESSES:
            self._drop()
            return None
        self._queues[addr] = collections.deque([action])
        return asyncio.ensure_future(self._drain(addr))

    async def _drain(self, addr: tuple[str, int]) -> None:
        queue = self._queues[addr]
        try:
            while queue:
                how = await deliver(queue.popleft(), timeout_s=self._timeout_s, secret=self._secret)
                if how is Delivery.DELIVERED:
                    self.delivered += 1
                elif how is Delivery.REFUSED:
                    self._drop()  # D answers: the next report may well be taken
                else:
                    self._drop(1 + len(queue))
                    queue.clear()
                    if len(self._failed_at) >= MAX_ADDRESSES:
                        del self._failed_at[next(iter(self._failed_at))]
                    self._failed_at[addr] = self._clock()
        finally:
            del self._queues[addr]
