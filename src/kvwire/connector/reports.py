"""``report_failed``: P tells D that a registration failed when no notification can reach D.

P writes into D only after loading D's agent (its full handshake with D); when that handshake fails, P
cannot send D the ``failed`` notification, and D would wait for its liveness timeout to give up on P. The
report goes to D's side channel instead (the address D named in its ``push_reg``), signed like a metadata
request; D feeds it to its core exactly as the ``failed`` notification it stands for, from the P rank it
names, so the core's own checks (known transfer, that P life, that rank) apply unchanged. Which reports
go and which are dropped is ``kvwire.core.reports.ReportCore``'s; this module connects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import assert_never

from kvwire.core.io import NotifIn, ReportFailure
from kvwire.core.reports import (
    DEFAULT_BACKOFF_S,
    MAX_ADDRESSES,
    MAX_QUEUED_PER_ADDRESS,
    UNDELIVERED,
    Deliver,
    Delivery,
    Ended,
    ReportCore,
    Submit,
)
from kvwire.errors import HandshakeTimeout, KvwireError, PeerUnreachable
from kvwire.handshake.client import send_report
from kvwire.handshake.types import PeerAddress
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import Failed, ReportFailed
from kvwire.transport.base import make_agent_name

log = logging.getLogger("kvwire.connector")

__all__ = [
    "MAX_ADDRESSES",
    "MAX_QUEUED_PER_ADDRESS",
    "UNDELIVERED",
    "Delivery",
    "Reporter",
    "as_notification",
    "deliver",
    "report_of",
]


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
    """The driver of ``kvwire.core.reports.ReportCore`` (which report goes when, what is dropped): one
    asyncio task per address while its queue drains, one connection at a time. Reads time only through
    ``clock`` (the connector's)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        secret: bytes | None,
        backoff_s: float = DEFAULT_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
        drops: Counter[str] | None = None,
        allowed: PeerAllowList | None = None,
    ) -> None:
        # ``drops``: the connector's dropped-notification counter (``/metrics``), where undelivered reports
        # are counted as ``report_undelivered``.
        self.core = ReportCore(secret=secret is not None, backoff_s=backoff_s, drops=drops, allowed=allowed)
        self._timeout_s = timeout_s
        self._secret = secret
        self._clock = clock

    @property
    def delivered(self) -> int:
        return self.core.delivered

    @property
    def dropped(self) -> int:
        return self.core.dropped

    def submit(self, action: ReportFailure) -> asyncio.Task[None] | None:
        """Queue ``action``; a new task when this address had none draining (the caller tracks it)."""
        task = None
        for step in self.core.handle(self._clock(), Submit(action)):
            match step:
                case Deliver():
                    task = asyncio.ensure_future(self._drain(step))
                case _:
                    assert_never(step)
        return task

    async def _drain(self, first: Deliver) -> None:
        step: Deliver | None = first
        try:
            while step is not None:
                how = await deliver(step.report, timeout_s=self._timeout_s, secret=self._secret)
                nxt = self.core.handle(self._clock(), Ended(step.addr, how))
                step = nxt[0] if nxt else None
        finally:
            if step is not None:  # cancelled mid-delivery (shutdown)
                self.core.abandon(first.addr)
