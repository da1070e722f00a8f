"""P's cores (push and pull) driven by hand in explicit time: every timed rule at its boundary, the cancel and
re-handshake paths, and the refusal of stray input. No threads, no sleeps, no agents: each test feeds
``(now, input)`` and asserts the exact actions and events that come back (``kvwire.testing.core_harness``).

Times are binary fractions (0.25, 5.125, ...) so that ``a + b`` lands exactly where the rule's boundary is;
the timers run at most every ``TIMER_PERIOD_S``, so two ticks that must both check are further apart than
that (``CoreHarness.ticks`` refuses a shorter step).
"""

from __future__ import annotations

import dataclasses
import re

import msgspec
import pytest

from kvwire.core.base import DropReason, Feeder, Refused
from kvwire.core.events import ProducerOutcome
from kvwire.core.io import (
    Abort,
    Action,
    Emit,
    Finished,
    ForgetPeer,
    NotifIn,
    PostWrite,
    Reap,
    Release,
    ReportFailure,
    Send,
    StartHandshake,
    TouchPeer,
)
from kvwire.protocol.codec import decode_notif
from kvwire.protocol.messages import (
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
)
from kvwire.testing.core_harness import TestEngine, events, one, only, protocol, sent
from kvwire.testing.cores_env import BLOCKS, CFG, D_BLOCKS, TID, TOKENS, P, freed
from kvwire.transport.base import PeerMode


def test_push_happy_path_posts_one_write_with_done_attached_and_frees_once() -> None:
    t = P()
    w = t.writing(0.0)
    assert (w.key, w.peer, w.transfer_id) == ((0, 0), t.d.agent(), TID)
    assert w.nbytes == 2 * 4 * 32  # two blocks x (2 layers x K,V) x 32 bytes per block

    def rows(engine: TestEngine, first_block: int) -> list[tuple[int, int, int]]:
        # Blocks first_block and first_block + 1 are adjacent: one coalesced row per region.
        regions = engine.layouts[(0, 0)].regions
        return sorted((r.base_addr + first_block * r.block_len, 2 * r.block_len, 0) for r in regions)

    assert sorted(map(tuple, w.src.tolist())) == rows(t.p, BLOCKS[0])
    assert sorted(map(tuple, w.dst.tolist())) == rows(t.d, D_BLOCKS[0])
    # D's done rides the write's last byte, stating what it wrote: 8 tokens x 32 bytes of KV each
    done = Done(
        transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, num_blocks=2, nbytes=256
    )
    assert decode_notif(w.notif) == done
    out = t.h.ended(0.25, w.token)
    assert out == [Release(w.token), Emit(freed(ProducerOutcome.SENT))]
    assert t.core.live_requests == 0


def test_fence_write_starts_at_fence_at_and_is_refused_just_after() -> None:
    t = P()
    t.registered(0.0, fence_ms=1_000)  # fence_at = 1.0
    out = t.h.at(1.0, Finished(TID, BLOCKS, TOKENS))
    assert only(out, PostWrite) and not sent(out)

    t = P()
    t.registered(0.0, fence_ms=1_000)
    out = t.h.at(1.0 + 2**-20, Finished(TID, BLOCKS, TOKENS))
    # No write; the request's only registration failed: its blocks are freeable at once.
    assert protocol(out) == [t.failed(FailReason.FENCE_EXPIRED), Emit(freed(ProducerOutcome.FAILED))]


def test_fence_of_a_registration_waiting_for_prefill_expires_on_a_tick_just_after_fence_at() -> None:
    t = P()
    t.registered(0.0, fence_ms=1_000)
    assert protocol(t.h.ticks(1.0, 0.25)) == []
    assert protocol(t.h.tick(1.0625)) == [t.failed(FailReason.FENCE_EXPIRED)]
    # Prefill ends later: nothing to write, every registration ended, the blocks are freed at once.
    out = t.h.at(1.25, Finished(TID, BLOCKS, TOKENS))
    assert protocol(out) == [out[-1]] and events(out) == [freed(ProducerOutcome.FAILED)]


@pytest.mark.parametrize(("answered_at", "writes"), [(1.0, True), (1.0 + 2**-20, False)])
def test_fence_applies_when_ds_handshake_answers_after_prefill(answered_at: float, writes: bool) -> None:
    t = P()
    hs = one(t.from_d(0.0, t.push_reg(fence_ms=1_000)), StartHandshake)
    assert t.h.at(0.5, Finished(TID, BLOCKS, TOKENS)) == []  # waits for D to be loaded
    t.h.ticks(answered_at, 0.25)  # the fence is the handshake's to apply: no tick fails it meanwhile
    out = t.h.done(answered_at, hs.token, t.d.peer_rank())
    if writes:
        assert only(out, PostWrite) and sent(out) == []
    else:
        assert out == [t.failed(FailReason.FENCE_EXPIRED), Emit(freed(ProducerOutcome.FAILED))]


def test_shutdown_tells_loaded_ds_and_frees_every_held_request() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000))
    t.registered(0.0, fence_ms=60_000)
    t.h.at(0.0, Finished("req-2", (5, 6), TOKENS))
    out = t.core.shutdown(0.25)
    assert t.failed(FailReason.SHUTDOWN) in out
    assert events(out) == [freed(ProducerOutcome.SHUTDOWN, "req-2")]  # req-1 was never held


def test_fence_is_the_smaller_of_ds_and_ps() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=500))
    t.registered(0.0, fence_ms=60_000)  # P's 0.5 s wins
    out = t.h.at(0.5 + 2**-20, Finished(TID, BLOCKS, TOKENS))
    assert protocol(out)[0] == t.failed(FailReason.FENCE_EXPIRED)


def test_lease_expires_at_lease_end_and_heartbeats_extend_it() -> None:
    t = P()
    assert t.h.at(0.0, Finished(TID, BLOCKS, TOKENS)) == []
    assert events(t.h.ticks(29.75, 0.25)) == []
    assert events(t.h.tick(30.0)) == [freed(ProducerOutcome.EXPIRED)]
    # Held to the lease with nobody registered: counted (kvwire_failures_total{reason="lease_expired"},
    # vLLM NIXL's num_kv_expired_reqs), where it was counted nowhere.
    assert t.core.stats.failures == {FailReason.LEASE_EXPIRED: 1}

    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    t.h.ticks(20.0, 0.25)
    out = t.from_d(20.0, t.heartbeat(TID, "unknown-tid"))  # lease now ends at 50
    assert [type(a).__name__ for a in out] == ["TouchPeer"]
    assert t.core.stats.dropped_notifs["heartbeat_unknown_ids"] == 1
    assert events(t.h.ticks(49.75, 0.25)) == []
    assert events(t.h.tick(50.0)) == [freed(ProducerOutcome.EXPIRED)]


def test_tombstone_answers_a_late_push_reg_and_cancel_until_it_is_forgotten() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert events(t.h.ticks(30.0, 0.5)) == [freed(ProducerOutcome.EXPIRED)]  # tombstone until 90
    t.h.ticks(40.0, 0.5)
    # A late push_reg: failed/lease_expired once D is loaded (the handshake runs for the answer only).
    hs = one(t.from_d(40.0, t.push_reg()), StartHandshake)
    out = t.h.done(40.0, hs.token, t.d.peer_rank())
    assert out == [t.failed(FailReason.LEASE_EXPIRED)]
    # A late cancel (from a D that never registered here): cancel_ack, nothing written.
    t2 = P()
    t2.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    t2.h.ticks(40.0, 0.5)
    assert t2.from_d(40.0, t2.cancel()) == [TouchPeer("D"), t2.cancel_ack(wrote=False)]  # D's first word
    # Forgotten at 30 + 60: then the transfer is unknown. Until then it is known (the same cancel again,
    # a network duplicate, is dropped as one: one ending message per registration).
    t2.h.ticks(89.5, 0.5)
    with pytest.raises(Refused) as dup:
        t2.from_d(89.5, t2.cancel())
    assert dup.value.reason is DropReason.DUPLICATE
    t2.h.tick(90.0)
    # Forgotten: the cancel is now one of a transfer P has not seen (a D that declined it before P
    # finished): acked, and an ended record is all it leaves (nothing is held or freed).
    assert t2.from_d(90.0, t2.cancel()) == [t2.cancel_ack(wrote=False)]
    assert t2.core.live_requests == 0


def test_tombstone_of_an_aborted_request_answers_aborted() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert events(t.h.at(0.25, Abort(TID))) == [freed(ProducerOutcome.ABORTED)]
    hs = one(t.from_d(0.5, t.push_reg()), StartHandshake)
    assert t.h.done(0.5, hs.token, t.d.peer_rank()) == [t.failed(FailReason.ABORTED)]


def test_p_declares_a_silent_d_dead_after_liveness_timeout_not_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000))
    t.registered(0.0, fence_ms=60_000)  # prefill still running: P holds the registration for D
    assert protocol(t.h.ticks(5.0, 0.25)) == []
    with caplog.at_level("WARNING", logger="kvwire.connector"):
        out = protocol(t.h.tick(5.0625))
    assert out == [t.failed(FailReason.PEER_DEAD), ForgetPeer("D", "D-life1")]
    assert t.core.stats.peers_declared_dead == 1
    # The log says what P held for D: here a registration whose prefill had not ended.
    (line,) = [r.getMessage() for r in caplog.records if "declared dead" in r.getMessage()]
    assert f"P held for it: {TID} (prefilling; registered; D handshake done)" in line, line


def test_p_names_a_write_stuck_in_flight_when_it_declares_d_dead(caplog: pytest.LogCaptureFixture) -> None:
    """A silence with a write in flight (the write posted, never seen to end) says so, with its age."""
    t = P(dataclasses.replace(CFG, fence_ms=60_000, transfer_timeout_s=60.0))
    t.registered(0.0, fence_ms=60_000)
    t.h.at(0.5, Finished(TID, BLOCKS, TOKENS))
    with caplog.at_level("WARNING", logger="kvwire.connector"):
        t.h.ticks(5.5, 0.25)
    (line,) = [r.getMessage() for r in caplog.records if "declared dead" in r.getMessage()]
    assert re.search(rf"{TID} \(held; \w+, write in flight [45]\.\d s; D handshake done\)", line), line


def test_p_liveness_counts_from_ds_last_word() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000))
    t.registered(0.0, fence_ms=60_000)
    t.h.ticks(3.0, 0.25)
    t.from_d(3.0, t.heartbeat(TID))
    assert protocol(t.h.ticks(8.0, 0.25)) == []
    assert protocol(t.h.tick(8.0625))[0] == t.failed(FailReason.PEER_DEAD)


def test_prefill_ending_after_d_was_declared_dead_frees_at_once_without_a_write() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000))
    t.registered(0.0, fence_ms=60_000)
    t.h.ticks(5.0625, 0.25)
    assert t.core.stats.failures[FailReason.PEER_DEAD] == 1
    out = t.h.at(5.25, Finished(TID, BLOCKS, TOKENS))
    assert out == [Emit(freed(ProducerOutcome.FAILED))]


def test_p_heartbeats_a_long_prefill_and_keeps_d_in_use() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000, liveness_timeout_s=50.0))
    t.registered(0.0, fence_ms=60_000)
    out = t.h.ticks(20.0, 0.25)
    beats = [a for a in out if isinstance(a, Send) and isinstance(a.msg, Heartbeat)]
    assert len(beats) == 20  # one per heartbeat_interval_s: at 0.25, 1.25, ..., 19.25
    assert {b.peer for b in beats} == {t.d.agent()}
    assert sent(out, Heartbeat) == [t.p_heartbeat(TID)] * 20
    assert only(out, Reap) == [Reap(frozenset({"D"}))] * 20  # D's agents must not be reaped meanwhile
    t.h.at(20.0, Finished(TID, BLOCKS, TOKENS))
    assert only(t.h.ticks(21.0, 0.25), Reap) == [Reap(frozenset({"D"}))]  # the write is in flight


def test_p_releases_a_write_in_flight_to_a_dead_d_and_frees_after_the_release() -> None:
    t = P(dataclasses.replace(CFG, transfer_timeout_s=60.0))
    w = t.writing(0.0)
    t.h.ticks(5.0, 0.25)
    out = protocol(t.h.tick(5.0625))
    assert out == [
        Release(w.token),
        t.failed(FailReason.PEER_DEAD),
        ForgetPeer("D", "D-life1"),
        out[-1],
    ]
    assert events(out) == [freed(ProducerOutcome.FAILED)]


def test_transfer_timeout_releases_the_write_and_reports_failed() -> None:
    cfg = dataclasses.replace(CFG, transfer_timeout_s=2.0, liveness_timeout_s=50.0)
    t = P(cfg)
    w = t.writing(0.0)
    assert protocol(t.h.ticks(2.0, 0.25)) == []
    out = protocol(t.h.tick(2.0625))
    assert out[:2] == [Release(w.token), t.failed(FailReason.TRANSFER_TIMEOUT)]
    assert events(out) == [freed(ProducerOutcome.FAILED)]


def test_recall_after_a_pause_longer_than_liveness_minus_heartbeat() -> None:
    cfg = dataclasses.replace(CFG, transfer_timeout_s=60.0, liveness_timeout_s=50.0, heartbeat_interval_s=2.0)
    # Threshold: 50 - 2 = 48 s without a tick.
    t = P(cfg)
    w = t.writing(0.0)
    t.h.tick(0.0)
    assert protocol(t.h.tick(48.0)) == []  # a gap of exactly 48 s is no pause
    t = P(cfg)
    w = t.writing(0.0)
    t.h.tick(0.0)
    out = protocol(t.h.tick(48.0625))
    assert out == [Release(w.token), t.failed(FailReason.TRANSFER_TIMEOUT), out[-1]]
    assert events(out) == [freed(ProducerOutcome.FAILED)]


def answered_stale(t: P, now: float, tid: str = TID) -> list[Action]:
    """A push_reg queued during a freeze: P handshakes with D only to answer it; what follows the answer."""
    hs = one(t.from_d(now, t.push_reg(tid)), StartHandshake)
    return t.h.done(now, hs.token, t.d.peer_rank(mode=PeerMode.FULL))


def test_push_regs_queued_during_a_freeze_are_refused_until_the_next_tick() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    t.h.tick(0.0)
    t.h.tick(4.0)  # a gap of exactly liveness 5 - heartbeat 1 is no freeze
    assert only(t.from_d(4.0, t.push_reg("req-0")), StartHandshake)
    t.h.tick(8.5)  # 4.5 s without input: a freeze; the next notifications queued up during it
    out = answered_stale(t, 8.5)
    assert sent(out, Failed) == [t.failed(FailReason.FENCE_EXPIRED).msg]
    assert not [a for a in out if isinstance(a, PostWrite)]  # nothing is written for it
    assert t.from_d(8.5, t.heartbeat(TID)) == []  # proves nothing about D's view of P now
    # The next tick ends the thaw: a push_reg is served again.
    t.h.tick(8.75)
    assert only(t.from_d(8.75, t.push_reg("req-2")), StartHandshake)


def test_a_freeze_noticed_on_a_notification_refuses_until_the_tick_after_next() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    # The first input after the freeze is a queued push_reg: answered failed, not served.
    assert sent(answered_stale(t, 4.5), Failed) == [t.failed(FailReason.FENCE_EXPIRED).msg]
    t.h.tick(4.5)  # drains what queued up
    assert sent(answered_stale(t, 4.5, "req-2"), Failed) == [t.failed(FailReason.FENCE_EXPIRED, "req-2").msg]
    t.h.tick(4.75)
    assert only(t.from_d(4.75, t.push_reg("req-3")), StartHandshake)


def test_a_push_reg_queued_during_a_freeze_is_answered_failed() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    t.h.tick(0.0)
    t.h.tick(4.5)
    assert sent(answered_stale(t, 4.5), Failed) == [t.failed(FailReason.FENCE_EXPIRED).msg]


def test_cancel_during_a_write_that_completes_ends_with_its_done_alone() -> None:
    """The done went with the write (attached to it): one ending message per registration, so no
    cancel_ack follows (P used to send both, and D dropped the second as a duplicate)."""
    t = P()
    w = t.writing(0.0)
    assert t.from_d(0.25, t.cancel()) == []  # CANCEL_PENDING: the write cannot be recalled
    assert t.from_d(0.375, t.cancel()) == []  # a repeat changes nothing
    out = t.h.ended(0.5, w.token, ok=True)
    assert out == [Release(w.token), out[-1]] and sent(out, CancelAck) == []
    assert events(out) == [freed(ProducerOutcome.SENT)]
    assert t.core.stats.transfers_done == 1


def test_cancel_during_writing_then_failed_write_acks_wrote_true() -> None:
    t = P()
    w = t.writing(0.0)
    t.from_d(0.25, t.cancel())
    out = t.h.ended(0.5, w.token, ok=False)
    assert out[:2] == [Release(w.token), t.cancel_ack(wrote=True)]  # it may have landed in part


def test_cancel_crossing_done_gets_no_ack() -> None:
    t = P()
    w = t.writing(0.0)
    t.h.ended(0.25, w.token)
    # Request ended (tombstone): the registration is in FREED, which takes no cancel.
    with pytest.raises(Refused) as err:
        t.from_d(0.5, t.cancel())
    assert err.value.reason is DropReason.LATE


def test_cancel_before_push_reg_refuses_that_push_reg() -> None:
    """A cancel with no registration: D gave the request up before it registered (it dropped the request,
    or declined to load it), so P frees the blocks at once, not at its lease, and refuses that D rank's
    push_reg if it comes after all (overtaken by its cancel)."""
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    gave_up = [TouchPeer("D"), t.cancel_ack(wrote=False), Emit(freed(ProducerOutcome.ABORTED))]
    assert t.from_d(0.25, t.cancel()) == gave_up  # D's first word
    with pytest.raises(Refused) as err:
        t.from_d(0.5, t.push_reg())
    assert err.value.reason is DropReason.CANCELLED
    assert t.core.registrations(TID) == 0 and t.h.log[-len(gave_up) + 1 :] == gave_up[1:]  # nothing since


def test_a_duplicated_cancel_before_push_reg_is_acked_once() -> None:
    """The network duplicated a cancel that overtook its push_reg: one cancel_ack (kvwire sim --requests
    25000 --seed 101 found the second one)."""
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    gave_up = [TouchPeer("D"), t.cancel_ack(wrote=False), Emit(freed(ProducerOutcome.ABORTED))]
    assert t.from_d(0.25, t.cancel()) == gave_up  # D's first word
    with pytest.raises(Refused) as err:
        t.from_d(0.25, t.cancel())
    assert err.value.reason is DropReason.DUPLICATE
    with pytest.raises(Refused):
        t.from_d(0.5, t.push_reg())
    assert sum(1 for m in t.h.log if m == t.cancel_ack(wrote=False)) == 1


def test_cancel_of_a_registration_waiting_for_prefill_acks_at_once() -> None:
    t = P()
    t.registered(0.0)
    assert t.from_d(0.25, t.cancel()) == [t.cancel_ack(wrote=False)]
    # Every registration ended while prefilling: the request ends, with no event (never held).
    assert events(t.h.at(0.5, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.ABORTED)]


def test_failed_post_fails_the_registration() -> None:
    t = P()
    t.h.accept = lambda a: not isinstance(a, PostWrite)
    t.registered(0.0)
    out = t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert [type(a).__name__ for a in out] == ["PostWrite", "Send", "Emit"]
    assert out[1] == t.failed(FailReason.POST_FAILED) and events(out) == [freed(ProducerOutcome.FAILED)]


@pytest.mark.parametrize(
    ("reason", "nobody_listens", "told"),
    [
        (FailReason.HANDSHAKE_FAILED, False, FailReason.HANDSHAKE_FAILED),  # timeout, bad reply
        (FailReason.INCOMPATIBLE, False, FailReason.INCOMPATIBLE),
        (FailReason.UNAUTHORIZED, False, FailReason.HANDSHAKE_FAILED),
        (FailReason.HANDSHAKE_FAILED, True, None),  # D's side channel refuses connections: nobody to tell
    ],
)
def test_d_handshake_failure_reports_to_d_side_channel_and_frees(
    reason: FailReason, nobody_listens: bool, told: FailReason | None
) -> None:
    """No notification can reach D without its agent: D is told on its side channel (a ReportFailure
    action), with the reason, unless nothing listens there."""
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    hs = one(t.from_d(0.0, t.push_reg()), StartHandshake)
    out = t.h.done(0.25, hs.token, None, "refused", reason, nobody_listens=nobody_listens)
    assert events(out) == [freed(ProducerOutcome.FAILED)] and not [a for a in out if isinstance(a, Send)]
    reports = [a for a in out if isinstance(a, ReportFailure)]
    if told is None:
        assert reports == []
    else:
        assert len(reports) == 1 and (reports[0].host, reports[0].port) == (hs.host, hs.port)
        assert reports[0].failed == t.failed(told).msg and reports[0].remote == (0, 0)


def test_d_handshake_failure_during_the_prefill_ends_the_registration_at_once() -> None:
    """The push_reg came before the prefill ended: the handshake's failure ends the registration and tells
    D then, not when the prefill ends (it may be long) or at the fence."""
    t = P()
    hs = one(t.from_d(0.0, t.push_reg()), StartHandshake)
    out = t.h.done(0.1, hs.token, None, "incompatible", FailReason.INCOMPATIBLE)
    reports = [a for a in out if isinstance(a, ReportFailure)]
    assert len(reports) == 1 and reports[0].failed == t.failed(FailReason.INCOMPATIBLE).msg
    assert events(out) == []  # the request lives on: the engine has not finished it
    out = t.h.at(0.2, Finished(TID, BLOCKS, TOKENS))
    assert events(out) == [freed(ProducerOutcome.FAILED)] and not [a for a in out if isinstance(a, Send)]


def test_a_registration_refused_before_the_handshake_still_reaches_d_when_the_handshake_fails() -> None:
    """The ``failed`` waited for D to be loaded; the handshake then failed: it goes as the report."""
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    bad = msgspec.structs.replace(t.push_reg(), num_cached_tokens=TOKENS + 4)  # more cached than asked
    hs = one(t.from_d(0.0, bad), StartHandshake)
    out = t.h.done(0.1, hs.token, None, "timed out")
    reports = [a for a in out if isinstance(a, ReportFailure)]
    assert len(reports) == 1 and reports[0].failed == t.failed(FailReason.BAD_REGISTRATION).msg
    assert reports[0].remote_incarnation == "D-life1"


def test_a_freeze_noticed_on_a_refused_input_still_recalls_its_writes_and_frees() -> None:
    """The recall a freeze starts is decided by the gap, not by the input that reveals it: when that input
    was refused (a malformed notification), the driver dropped every action of the step. The write was
    never released, D never told, the request's blocks never freed."""
    t = P()
    w = t.writing(0.0)
    got: list[Action] = []
    refused: list[Exception] = []
    feeder = Feeder(t.core, got.append, lambda _item, exc: refused.append(exc))
    feeder.feed(7.0, NotifIn((0, 0), t.d.agent(), b"garbage"))  # 7 s since the last input: frozen
    assert [type(e) for e in refused] == [Refused]
    assert Release(w.token) in got and events(got) == [freed(ProducerOutcome.FAILED)]
    assert [a.msg.reason for a in got if isinstance(a, Send) and isinstance(a.msg, Failed)] == [
        FailReason.TRANSFER_TIMEOUT
    ]
    assert t.core.salvage() == []  # handed over once
