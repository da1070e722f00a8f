"""The report core in virtual time: which ``report_failed`` goes, when, and what is dropped."""

from __future__ import annotations

from kvwire.core.io import ReportFailure
from kvwire.core.reports import (
    MAX_QUEUED_PER_ADDRESS,
    UNDELIVERED,
    Deliver,
    Delivery,
    Ended,
    ReportCore,
    Submit,
)
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.messages import Failed, FailReason

ADDR = ("10.0.0.1", 7000)


def _report(tid: str, reason: FailReason = FailReason.HANDSHAKE_FAILED, host: str = ADDR[0]) -> ReportFailure:
    failed = Failed(transfer_id=tid, engine_id="P", incarnation="P-1", tp_rank=0, pp_rank=0, reason=reason)
    return ReportFailure((0, 0), host, ADDR[1], (0, 0), failed)


def test_one_delivery_at_a_time_per_address_in_order() -> None:
    core = ReportCore(secret=False)
    assert core.handle(0.0, Submit(_report("a"))) == [Deliver(ADDR, _report("a"))]
    assert core.handle(0.0, Submit(_report("b"))) == []  # queued behind a
    assert core.handle(0.0, Submit(_report("c"))) == []
    assert core.handle(0.1, Ended(ADDR, Delivery.DELIVERED)) == [Deliver(ADDR, _report("b"))]
    assert core.handle(0.2, Ended(ADDR, Delivery.REFUSED)) == [Deliver(ADDR, _report("c"))]
    assert core.handle(0.3, Ended(ADDR, Delivery.DELIVERED)) == [] and not core.queues
    assert (core.delivered, core.dropped) == (2, 1)


def test_an_unanswered_address_drops_its_queue_and_backs_off_in_virtual_time() -> None:
    core = ReportCore(secret=True, backoff_s=10.0)
    core.handle(0.0, Submit(_report("a")))
    for tid in "bcd":
        core.handle(0.0, Submit(_report(tid)))
    assert core.handle(1.0, Ended(ADDR, Delivery.UNANSWERED)) == []
    assert core.dropped == 4 and not core.queues
    assert core.handle(10.9, Submit(_report("e"))) == [] and core.dropped == 5  # still backing off
    assert core.handle(11.0, Submit(_report("f"))) == [Deliver(ADDR, _report("f"))]


def test_no_overload_report_without_a_secret_and_never_to_a_disallowed_address() -> None:
    open_core = ReportCore(secret=False, allowed=PeerAllowList.parse("10.0.0.0/8"))
    assert open_core.handle(0.0, Submit(_report("a", FailReason.OVERLOADED))) == []
    assert open_core.handle(0.0, Submit(_report("b", host="192.168.1.1"))) == []
    assert open_core.drops[UNDELIVERED] == 2
    sealed = ReportCore(secret=True)
    assert sealed.handle(0.0, Submit(_report("a", FailReason.OVERLOADED))) != []


def test_queues_are_bounded() -> None:
    core = ReportCore(secret=False)
    for i in range(MAX_QUEUED_PER_ADDRESS + 11):
        core.handle(0.0, Submit(_report(f"t{i}")))
    assert len(core.queues[ADDR]) == MAX_QUEUED_PER_ADDRESS and core.dropped == 10
