"""The sans-IO cores driven by hand in explicit time: every timed rule at its boundary, the cancel and
re-handshake paths, and the refusal of stray input. No threads, no sleeps, no agents: each test feeds
``(now, input)`` and asserts the exact actions and events that come back (``kvwire.testing.core_harness``).

Times are binary fractions (0.25, 5.125, ...) so that ``a + b`` lands exactly where the rule's boundary is;
the timers run at most every ``TIMER_PERIOD_S``, so two ticks that must both check are further apart than
that (``CoreHarness.ticks`` refuses a shorter step).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvwire.core.base import DropReason, Refused
from kvwire.core.config import ConnectorConfig
from kvwire.core.consumer import PushConsumerCore
from kvwire.core.consumer_pull import PullConsumerCore
from kvwire.core.events import ConsumerEvent, ConsumerEventKind, ProducerEvent, ProducerOutcome
from kvwire.core.io import (
    Abort,
    Action,
    Allocated,
    Emit,
    Finished,
    ForgetPeer,
    HandshakeDone,
    NotifIn,
    PostRead,
    PostWrite,
    Reap,
    Release,
    RemoteEngine,
    Send,
    StartHandshake,
)
from kvwire.core.producer import PullProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    PushReg,
    TransferMode,
)
from kvwire.testing.core_harness import CoreHarness, TestEngine, events, one, only, protocol, sent
from kvwire.transport.base import PeerMode

PUSH, PULL = TransferMode.PUSH, TransferMode.PULL
CFG = ConnectorConfig(
    kv_lease_duration_s=30.0,
    fence_ms=2_000,
    heartbeat_interval_s=1.0,
    liveness_timeout_s=5.0,
    dead_peer_grace_s=1.0,
    transfer_timeout_s=10.0,
    tombstone_s=60.0,
)
TID = "req-1"
BLOCKS = (3, 4)  # P's blocks for TID
D_BLOCKS = [7, 8]  # D's
TOKENS = 8  # two blocks of 4


# -- P (push) ---------------------------------------------------------------------------------------------


class P:
    """A push (or pull) producer core with one D peer, both TP1/PP1."""

    def __init__(self, cfg: ConnectorConfig = CFG, mode: TransferMode = PUSH) -> None:
        self.p = TestEngine.build("P", mode=mode, port=5000)
        self.d = TestEngine.build("D", mode=mode, port=6000)
        cfg = dataclasses.replace(cfg, mode=mode)
        kind = PushProducerCore if mode is PUSH else PullProducerCore
        self.core = kind(self.p.info, self.p.layouts, self.p.num_blocks, cfg)
        self.h = CoreHarness(self.core)

    def push_reg(self, tid: str = TID, fence_ms: int = 2_000, blocks: list[int] | None = None) -> PushReg:
        return PushReg(
            transfer_id=tid,
            engine_id=self.d.engine_id,
            incarnation=self.d.incarnation,
            tp_rank=0,
            tp_size=1,
            host=self.d.host,
            port=self.d.port,
            block_ids=D_BLOCKS if blocks is None else blocks,
            num_tokens=TOKENS,
            fence_ms=fence_ms,
        )

    def from_d(self, now: float, msg: PushReg | Cancel | Heartbeat | Done | Failed) -> list[Action]:
        return self.h.at(now, self.d.notif(msg))

    def cancel(self, tid: str = TID) -> Cancel:
        return Cancel(transfer_id=tid, engine_id=self.d.engine_id, incarnation=self.d.incarnation)

    def heartbeat(self, *tids: str) -> Heartbeat:
        return Heartbeat(
            transfer_id="",
            engine_id=self.d.engine_id,
            incarnation=self.d.incarnation,
            transfer_ids=list(tids),
        )

    def p_heartbeat(self, *tids: str) -> Heartbeat:
        return Heartbeat(transfer_id="", engine_id="P", incarnation="P-life1", transfer_ids=list(tids))

    def registered(self, now: float, tid: str = TID, fence_ms: int = 2_000) -> None:
        """D's push_reg arrives at ``now`` and P's full handshake with D succeeds at once."""
        hs = one(self.from_d(now, self.push_reg(tid, fence_ms)), StartHandshake)
        assert (hs.key, hs.host, hs.port, hs.remote, hs.mode) == (
            (0, 0),
            "127.0.0.1",
            6000,
            (0, 0),
            PeerMode.FULL,
        )
        assert (hs.engine_id, hs.incarnation) == ("D", "D-life1")
        assert self.h.done(now, hs.token, self.d.peer_rank(mode=PeerMode.FULL)) == []

    def writing(self, now: float, tid: str = TID) -> PostWrite:
        """Registered and handshaken at ``now``, prefill ends at ``now``: the write is posted."""
        self.registered(now, tid)
        return one(self.h.at(now, Finished(tid, BLOCKS, TOKENS)), PostWrite)

    def failed(self, reason: FailReason, tid: str = TID) -> Send:
        msg = Failed(
            transfer_id=tid, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, reason=reason
        )
        return Send((0, 0), self.d.agent(), msg)

    def cancel_ack(self, wrote: bool, tid: str = TID) -> Send:
        msg = CancelAck(
            transfer_id=tid, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, wrote=wrote
        )
        return Send((0, 0), self.d.agent(), msg)


def freed(how: ProducerOutcome, tid: str = TID) -> ProducerEvent:
    return ProducerEvent(tid, how)


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
    # D's done rides the write's last byte
    done = Done(transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, num_blocks=2)
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
    assert t2.from_d(40.0, t2.cancel()) == [t2.cancel_ack(wrote=False)]
    # Forgotten at 30 + 60: then the transfer is unknown.
    t2.h.ticks(89.5, 0.5)
    assert t2.from_d(89.5, t2.cancel()) == [t2.cancel_ack(wrote=False)]
    t2.h.tick(90.0)
    with pytest.raises(Refused) as err:
        t2.from_d(90.0, t2.cancel())
    assert err.value.reason is DropReason.UNKNOWN_TRANSFER
    assert t2.h.log[-1] == t2.cancel_ack(wrote=False)  # the refused input left no action


def test_tombstone_of_an_aborted_request_answers_aborted() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert events(t.h.at(0.25, Abort(TID))) == [freed(ProducerOutcome.ABORTED)]
    hs = one(t.from_d(0.5, t.push_reg()), StartHandshake)
    assert t.h.done(0.5, hs.token, t.d.peer_rank()) == [t.failed(FailReason.ABORTED)]


def test_p_declares_a_silent_d_dead_after_liveness_timeout_not_before() -> None:
    t = P(dataclasses.replace(CFG, fence_ms=60_000))
    t.registered(0.0, fence_ms=60_000)  # prefill still running: P holds the registration for D
    assert protocol(t.h.ticks(5.0, 0.25)) == []
    out = protocol(t.h.tick(5.0625))
    assert out == [t.failed(FailReason.PEER_DEAD), ForgetPeer("D", "D-life1")]
    assert t.core.stats.peers_declared_dead == 1


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


def test_cancel_during_writing_waits_for_the_write_to_end_before_cancel_ack() -> None:
    t = P()
    w = t.writing(0.0)
    assert t.from_d(0.25, t.cancel()) == []  # CANCEL_PENDING: the write cannot be recalled
    assert t.from_d(0.375, t.cancel()) == []  # a repeat changes nothing
    out = t.h.ended(0.5, w.token, ok=True)
    assert out == [Release(w.token), t.cancel_ack(wrote=True), out[-1]]
    assert events(out) == [freed(ProducerOutcome.ABORTED)]


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
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert t.from_d(0.25, t.cancel()) == [t.cancel_ack(wrote=False)]
    with pytest.raises(Refused) as err:
        t.from_d(0.5, t.push_reg())
    assert err.value.reason is DropReason.CANCELLED
    assert t.core.registrations(TID) == 0 and t.h.log[-1] == t.cancel_ack(wrote=False)


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


def test_d_handshake_failure_sends_nothing_and_frees() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    hs = one(t.from_d(0.0, t.push_reg()), StartHandshake)
    out = t.h.done(0.25, hs.token, None, "refused")
    assert out == [out[-1]] and events(out) == [freed(ProducerOutcome.FAILED)]


def test_bad_d_block_ids_are_refused_before_any_write() -> None:
    t = P()
    hs = one(t.from_d(0.0, t.push_reg(blocks=[7, 99])), StartHandshake)  # D has 16 blocks
    assert t.h.done(0.0, hs.token, t.d.peer_rank()) == [t.failed(FailReason.BAD_REGISTRATION)]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x00garbage", DropReason.MALFORMED),
        (None, DropReason.WRONG_SENDER),
    ],
)
def test_p_refuses_malformed_and_misattributed_notifications(raw: bytes | None, reason: DropReason) -> None:
    t = P()
    msg = NotifIn((0, 0), "X/X-life1/pp0/tp0", raw if raw is not None else encode_notif(t.push_reg()))
    with pytest.raises(Refused) as err:
        t.h.at(0.0, msg)
    assert err.value.reason is reason and err.value.role == "producer"
    assert t.core.registrations(TID) == 0 and t.h.log == []


def test_p_refuses_duplicate_overload_and_unexpected() -> None:
    t = P(dataclasses.replace(CFG, max_early_registrations=1))
    t.from_d(0.0, t.push_reg())
    with pytest.raises(Refused) as dup:
        t.from_d(0.0, t.push_reg())
    with pytest.raises(Refused) as over:
        t.from_d(0.0, t.push_reg("req-2"))
    done = Done(transfer_id=TID, engine_id="D", incarnation="D-life1", tp_rank=0, pp_rank=0, num_blocks=2)
    with pytest.raises(Refused) as unexpected:
        t.from_d(0.0, done)
    with pytest.raises(Refused) as unknown:
        t.from_d(0.0, t.cancel("req-3"))
    reasons = [e.value.reason for e in (dup, over, unexpected, unknown)]
    assert reasons == [
        DropReason.DUPLICATE,
        DropReason.OVERLOAD,
        DropReason.UNEXPECTED,
        DropReason.UNKNOWN_TRANSFER,
    ]
    assert t.core.registrations(TID) == 1 and t.core.registrations("req-2") == 0
    assert t.core.early_registrations == 1


# -- P (pull) ---------------------------------------------------------------------------------------------


def d_end(t: P, ok: bool, tid: str = TID) -> Done | Failed:
    common = {"transfer_id": tid, "engine_id": "D", "incarnation": "D-life1", "tp_rank": 0, "pp_rank": 0}
    if ok:
        return Done(num_blocks=2, **common)  # type: ignore[arg-type]
    return Failed(reason=FailReason.WRITE_FAILED, **common)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ok", "how"), [(True, ProducerOutcome.PULLED), (False, ProducerOutcome.FAILED)])
def test_pull_producer_frees_on_ds_done_or_failed_once(ok: bool, how: ProducerOutcome) -> None:
    t = P(mode=PULL)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert events(t.from_d(1.0, d_end(t, ok))) == [freed(how)]
    assert t.from_d(1.0, d_end(t, ok)) == []  # another D rank's: the first one ended it


def test_pull_producer_lease_and_stray_messages() -> None:
    t = P(mode=PULL)
    with pytest.raises(Refused) as unknown:
        t.from_d(0.0, d_end(t, True))
    with pytest.raises(Refused) as unexpected:
        t.from_d(0.0, t.push_reg())
    assert (unknown.value.reason, unexpected.value.reason) == (
        DropReason.UNKNOWN_TRANSFER,
        DropReason.UNEXPECTED,
    )
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert events(t.h.ticks(29.75, 0.25)) == []
    assert events(t.h.tick(30.0)) == [freed(ProducerOutcome.EXPIRED)]


# -- D (push) ---------------------------------------------------------------------------------------------


class D:
    """A consumer core with one P peer, both TP1/PP1."""

    def __init__(self, cfg: ConnectorConfig = CFG, mode: TransferMode = PUSH) -> None:
        self.p = TestEngine.build("P", mode=mode, port=5000)
        self.d = TestEngine.build("D", mode=mode, port=6000)
        cfg = dataclasses.replace(cfg, mode=mode)
        kind = PushConsumerCore if mode is PUSH else PullConsumerCore
        self.core = kind(self.d.info, self.d.layouts, self.d.num_blocks, cfg, port=6000)
        self.h = CoreHarness(self.core)
        self.mode = mode

    @property
    def push_core(self) -> PushConsumerCore:
        assert isinstance(self.core, PushConsumerCore)
        return self.core

    def allocated(self, tid: str = TID) -> Allocated:
        remote = RemoteEngine("P", "127.0.0.1", 5000, block_ids=BLOCKS if self.mode is PULL else ())
        return Allocated(tid, tuple(D_BLOCKS), TOKENS, 0, remote)

    def start(self, now: float, tid: str = TID) -> list[Action]:
        """Allocated at ``now``; the handshake with P succeeds at once: what follows it."""
        hs = one(self.h.at(now, self.allocated(tid)), StartHandshake)
        mode = PeerMode.NOTIF_ONLY if self.mode is PUSH else PeerMode.FULL
        assert (hs.key, hs.port, hs.remote, hs.mode, hs.engine_id) == ((0, 0), 5000, (0, 0), mode, "P")
        return self.h.done(now, hs.token, self.p.peer_rank(mode=mode))

    def from_p(self, now: float, msg: Done | Failed | CancelAck | Heartbeat | Cancel) -> list[Action]:
        return self.h.at(now, self.p.notif(msg))

    def _common(self, tid: str) -> dict[str, object]:
        return {"transfer_id": tid, "engine_id": "P", "incarnation": "P-life1", "tp_rank": 0, "pp_rank": 0}

    def done(self, tid: str = TID) -> Done:
        return Done(num_blocks=2, **self._common(tid))  # type: ignore[arg-type]

    def failed(self, reason: FailReason, tid: str = TID) -> Failed:
        return Failed(reason=reason, **self._common(tid))  # type: ignore[arg-type]

    def cancel_ack(self, tid: str = TID) -> CancelAck:
        return CancelAck(wrote=False, **self._common(tid))  # type: ignore[arg-type]

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(transfer_id="", engine_id="P", incarnation="P-life1", transfer_ids=[TID])

    def cancel(self, tid: str = TID) -> Send:
        return Send((0, 0), self.p.agent(), Cancel(transfer_id=tid, engine_id="D", incarnation="D-life1"))

    def to_p(self, ok: bool, reason: FailReason | None = None) -> Send:
        """D's done (or failed) to P (pull: P may free its blocks)."""
        common = {"transfer_id": TID, "engine_id": "D", "incarnation": "D-life1", "tp_rank": 0, "pp_rank": 0}
        msg = Done(num_blocks=2, **common) if ok else Failed(reason=reason, **common)  # type: ignore[arg-type]
        return Send((0, 0), self.p.agent(), msg)


def ev(kind: ConsumerEventKind, reason: FailReason | None = None, tid: str = TID) -> ConsumerEvent:
    return ConsumerEvent(tid, kind, reason)


READY, FAILED, RELEASED = ConsumerEventKind.READY, ConsumerEventKind.FAILED, ConsumerEventKind.RELEASED


def test_push_consumer_registers_and_is_ready_on_done() -> None:
    t = D()
    out = t.start(0.0)
    reg = one(out, Send)
    assert reg.token and reg.peer == t.p.agent() and isinstance(reg.msg, PushReg)
    assert (reg.msg.block_ids, reg.msg.num_tokens, reg.msg.fence_ms, reg.msg.port) == (
        D_BLOCKS,
        TOKENS,
        2000,
        6000,
    )
    assert t.from_p(0.5, t.done()) == [Emit(ev(READY))]
    assert t.core.live_requests == 0


def declared_dead(t: D) -> StartHandshake:
    """P silent from 0: alive at exactly 5 s, declared dead at 5.125 (FAILED, cancel; blocks fenced), and
    a probe of who is at P's address now (returned, unanswered)."""
    assert protocol(t.h.ticks(5.0, 0.25)) == []
    out = protocol(t.h.tick(5.125))
    probe = one(out, StartHandshake)
    assert (probe.port, probe.remote, probe.mode, probe.engine_id) == (5000, (0, 0), PeerMode.NOTIF_ONLY, "P")
    assert out == [ForgetPeer("P", "P-life1"), probe, Emit(ev(FAILED, FailReason.PEER_DEAD)), t.cancel()]
    assert t.core.stats.peers_declared_dead == 1
    return probe


@pytest.mark.parametrize("answer", ["refused", "newer_life"])
def test_d_releases_a_dead_lifes_blocks_after_the_grace_when_its_address_confirms_it_gone(
    answer: str,
) -> None:
    t = D()
    t.start(0.0)
    probe = declared_dead(t)
    if answer == "refused":  # nobody listens: a killed process's socket is closed
        t.h.at(5.25, HandshakeDone(probe.token, None, "refused", nobody_listens=True))
    else:
        t.h.done(5.25, probe.token, dataclasses.replace(t.p.peer_rank(), incarnation="P-life2"))
    assert events(t.h.tick(6.125)) == [ev(RELEASED, FailReason.PEER_DEAD)]


def test_d_keeps_quarantine_when_its_probe_times_out_or_the_same_life_answers() -> None:
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)
    probe = declared_dead(t)
    t.h.done(5.25, probe.token, t.p.peer_rank())  # the same life's side channel: proves no recall yet
    assert events(t.h.ticks(8.125, 0.25)) == [] and t.push_core.quarantined() == 1


def test_d_declares_p_dead_at_liveness_timeout_and_releases_after_grace_once_p_speaks() -> None:
    t = D()
    t.start(0.0)
    declared_dead(t)
    t.from_p(5.5, t.heartbeat())  # the life speaks again (it recalled its writes first)
    # Blocks stay fenced for dead_peer_grace_s (a thawed P could still finish a write)
    assert events(t.h.ticks(6.125 - 2**-5, 0.0625)) == []  # the last tick 31 ms before the grace ends
    assert events(t.h.tick(6.125)) == [ev(RELEASED, FailReason.PEER_DEAD)]
    assert t.push_core.quarantined() == 0 and t.core.live_requests == 0


def test_d_keeps_an_unconfirmed_dead_lifes_blocks_until_the_quarantine_bound() -> None:
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)
    declared_dead(t)
    assert events(t.h.ticks(10.125 - 2**-5, 0.25)) == [] and t.push_core.quarantined() == 1  # bound: 10.125
    assert events(t.h.tick(10.125)) == [ev(RELEASED, FailReason.PEER_DEAD)]
    assert t.core.stats.quarantine_expired == 1


def test_d_releases_a_dead_lifes_blocks_when_a_newer_life_answers() -> None:
    t = D()
    t.start(0.0)
    declared_dead(t)
    t.h.ticks(6.25, 0.25)
    # Another request handshakes with the restarted P at the same address: the old process is over.
    p2 = TestEngine.build("P", incarnation="P-life2", port=5000)
    hs = one(t.h.at(6.25, t.allocated("req-2")), StartHandshake)
    t.h.done(6.25, hs.token, p2.peer_rank(mode=PeerMode.NOTIF_ONLY))
    assert events(t.h.tick(6.5)) == [ev(RELEASED, FailReason.PEER_DEAD)]


def test_d_forgets_a_dead_lifes_liveness_once_no_request_waits_on_it() -> None:
    t = D()
    t.start(0.0)
    declared_dead(t)
    assert t.core.watched_peers() == [("P", "P-life1")]
    t.from_p(5.5, t.heartbeat())
    t.h.ticks(6.125, 0.125)
    assert t.core.live_requests == 0
    t.h.ticks(7.25, 0.125)  # pruned at the next heartbeat
    assert t.core.watched_peers() == []


def test_a_p_declared_dead_then_heard_again_serves_the_next_request() -> None:
    # A healed partition: same life, declared dead meanwhile. The next request must not inherit the verdict.
    t = D()
    t.start(0.0)
    declared_dead(t)
    hs = one(t.h.at(5.25, t.allocated("req-2")), StartHandshake)
    out = t.h.done(5.25, hs.token, t.p.peer_rank(mode=PeerMode.NOTIF_ONLY))
    assert len(sent(out, PushReg)) == 1 and events(out) == []
    assert events(t.h.ticks(6.125, 0.125)) == []  # req-1: past its grace, but P has not spoken since
    assert events(t.from_p(6.25, t.done("req-2"))) == [ev(READY, tid="req-2")]
    assert events(t.h.tick(6.375)) == [ev(RELEASED, FailReason.PEER_DEAD)]  # P spoke: req-1 goes


def test_d_heartbeats_name_its_waiting_requests_and_keep_p_in_use() -> None:
    t = D(dataclasses.replace(CFG, liveness_timeout_s=50.0))
    t.start(0.0)
    out = t.h.ticks(10.0, 0.25)
    beats = sent(out, Heartbeat)
    assert len(beats) == 10 and all(b.transfer_ids == [TID] for b in beats)
    assert only(out, Reap) == [Reap(frozenset({"P"}))] * 10


def test_p_heartbeats_keep_a_long_prefill_alive_on_d() -> None:
    t = D()
    t.start(0.0)
    for second in range(1, 21):  # P heartbeats every second through a 20 s prefill
        assert events(t.h.ticks(float(second), 0.25)) == []
        t.from_p(float(second), t.heartbeat())
    assert events(t.from_p(20.5, t.done())) == [ev(READY)]
    assert t.core.stats.peers_declared_dead == 0


def test_d_liveness_counts_from_ps_last_word() -> None:
    t = D()
    t.start(0.0)
    t.h.ticks(3.0, 0.25)
    t.from_p(3.0, t.heartbeat())
    assert events(t.h.ticks(8.0, 0.25)) == []
    assert events(t.h.tick(8.125)) == [ev(FAILED, FailReason.PEER_DEAD)]


def test_a_cancel_ack_before_grace_ends_releases_at_once() -> None:
    t = D()
    t.start(0.0)
    t.h.ticks(5.125, 0.125)
    assert events(t.from_p(5.5, t.cancel_ack())) == [ev(RELEASED, FailReason.PEER_DEAD)]


def test_consumer_rehandshakes_once_after_a_failed_push_reg_send() -> None:
    t = D()
    t.h.accept = lambda a: not (isinstance(a, Send) and isinstance(a.msg, PushReg))
    out = t.start(0.0)
    assert [type(a).__name__ for a in out] == ["Send", "ForgetPeer", "StartHandshake"]
    assert out[1] == ForgetPeer("P", "P-life1")
    hs = out[2]
    assert isinstance(hs, StartHandshake) and hs.mode is PeerMode.NOTIF_ONLY
    out = t.h.done(0.25, hs.token, t.p.peer_rank(mode=PeerMode.NOTIF_ONLY))
    # The second send fails too: no third handshake; the request fails and, with nothing registered,
    # is released at once.
    assert only(out, StartHandshake) == [] and len(only(out, Send)) == 1
    assert events(out) == [ev(FAILED, FailReason.HANDSHAKE_FAILED), ev(RELEASED, FailReason.HANDSHAKE_FAILED)]


def test_consumer_rehandshake_then_success_registers() -> None:
    t = D()
    tries = iter([False, True])
    t.h.accept = lambda a: next(tries) if isinstance(a, Send) and isinstance(a.msg, PushReg) else True
    hs = one(t.start(0.0), StartHandshake)
    out = t.h.done(0.25, hs.token, t.p.peer_rank(mode=PeerMode.NOTIF_ONLY))
    assert len(sent(out, PushReg)) == 1 and events(out) == []
    assert events(t.from_p(0.5, t.done())) == [ev(READY)]


def test_failed_from_p_fails_and_releases_the_request() -> None:
    t = D()
    t.start(0.0)
    out = t.from_p(0.5, t.failed(FailReason.FENCE_EXPIRED))
    assert events(out) == [ev(FAILED, FailReason.FENCE_EXPIRED), ev(RELEASED, FailReason.FENCE_EXPIRED)]
    assert sent(out) == []  # that rank ended: no cancel to it


def test_engine_abort_cancels_and_waits_for_the_ack() -> None:
    t = D()
    t.start(0.0)
    out = t.h.at(0.5, Abort(TID))
    assert out == [t.cancel()]
    assert events(t.from_p(0.75, t.cancel_ack())) == [ev(RELEASED)]


def test_d_handshake_failure_fails_and_releases() -> None:
    t = D()
    hs = one(t.h.at(0.0, t.allocated()), StartHandshake)
    out = t.h.done(0.5, hs.token, None, "timed out")
    assert events(out) == [
        ev(FAILED, FailReason.HANDSHAKE_FAILED),
        ev(RELEASED, FailReason.HANDSHAKE_FAILED),
    ]


def test_d_refuses_stray_messages_and_changes_nothing() -> None:
    t = D()
    t.start(0.0)
    other = TestEngine.build("P", incarnation="P-life2")
    stale = other.notif(
        Done(transfer_id=TID, engine_id="P", incarnation="P-life2", tp_rank=0, pp_rank=0, num_blocks=2)
    )
    cases = [
        (t.p.notif(t.done("nope")), DropReason.UNKNOWN_TRANSFER),
        (stale, DropReason.STALE_INCARNATION),
        (t.p.notif(Cancel(transfer_id=TID, engine_id="P", incarnation="P-life1")), DropReason.UNEXPECTED),
        (t.p.notif(t.done(), to=(0, 1)), DropReason.UNKNOWN_TRANSFER),  # not a local rank of this request
    ]
    for notif, reason in cases:
        with pytest.raises(Refused) as err:
            t.h.at(0.5, notif)
        assert err.value.reason is reason and err.value.role == "consumer"
    assert t.core.live_requests == 1
    assert events(t.from_p(0.75, t.done())) == [ev(READY)]
    with pytest.raises(Refused) as late:
        t.from_p(0.75, t.done())
    assert late.value.reason is DropReason.UNKNOWN_TRANSFER


def test_d_with_two_p_ranks_waits_for_both_and_refuses_a_repeated_done() -> None:
    p2 = TestEngine.build("P", tp=2, port=5000)
    t = D()
    remote = RemoteEngine("P", "127.0.0.1", 5000, tp_size=2)
    hss = only(t.h.at(0.0, Allocated(TID, tuple(D_BLOCKS), TOKENS, 0, remote)), StartHandshake)
    assert [h.remote for h in hss] == [(0, 0), (0, 1)]
    for h in hss:
        reg = one(t.h.done(0.0, h.token, p2.peer_rank(h.remote, PeerMode.NOTIF_ONLY)), Send)
        assert reg.peer == p2.agent(h.remote)

    def done(rank: int) -> NotifIn:
        msg = Done(
            transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=rank, pp_rank=0, num_blocks=2
        )
        return p2.notif(msg, rank=(0, rank))

    assert t.h.at(0.25, done(0)) == []  # one of two
    with pytest.raises(Refused) as err:
        t.h.at(0.25, done(0))
    assert err.value.reason is DropReason.LATE
    assert events(t.h.at(0.5, done(1))) == [ev(READY)]


def test_a_core_asks_to_be_woken_at_least_every_heartbeat() -> None:
    t = P()
    t.h.at(3.0, Finished(TID, BLOCKS, TOKENS))
    assert t.core.wake_at() <= 3.0 + CFG.heartbeat_interval_s
    t.h.ticks(34.0, 0.25)  # the lease ran out at 33: only a tombstone is left (forgotten at 93)
    assert t.core.live_requests == 0 and t.core.wake_at() == 34.0 + CFG.heartbeat_interval_s


# -- D (pull) ---------------------------------------------------------------------------------------------


def test_pull_read_posted_ended_ready_then_done_to_p() -> None:
    t = D(mode=PULL)
    rd = one(t.start(0.0), PostRead)
    assert (rd.key, rd.peer, rd.nbytes, rd.transfer_id) == ((0, 0), t.p.agent(), 2 * 4 * 32, TID)
    out = t.h.ended(0.5, rd.token)
    assert out == [Release(rd.token), t.to_p(True), out[-1]]
    assert events(out) == [ev(READY)]


def test_pull_failed_read_tells_p_failed() -> None:
    t = D(mode=PULL)
    rd = one(t.start(0.0), PostRead)
    out = t.h.ended(0.5, rd.token, ok=False)
    assert out == [
        Release(rd.token),
        Emit(ev(FAILED, FailReason.WRITE_FAILED)),
        t.to_p(False, FailReason.WRITE_FAILED),  # no READ in flight any more: P may free its blocks
        Emit(ev(RELEASED, FailReason.WRITE_FAILED)),
    ]


def test_pull_read_timeout_releases_and_tells_p_failed() -> None:
    t = D(mode=PULL, cfg=dataclasses.replace(CFG, transfer_timeout_s=2.0))
    rd = one(t.start(0.0), PostRead)
    assert protocol(t.h.ticks(2.0, 0.25)) == []
    out = protocol(t.h.tick(2.125))
    assert out == [
        Release(rd.token),
        Emit(ev(FAILED, FailReason.TRANSFER_TIMEOUT)),
        t.to_p(False, FailReason.TRANSFER_TIMEOUT),
        Emit(ev(RELEASED, FailReason.TRANSFER_TIMEOUT)),
    ]


def test_pull_abort_during_read_waits_for_the_read_to_end() -> None:
    t = D(mode=PULL)
    rd = one(t.start(0.0), PostRead)
    assert t.h.at(0.25, Abort(TID)) == []  # the READ lands in D's blocks: it must end first
    out = t.h.ended(0.5, rd.token)
    assert out[:2] == [Release(rd.token), t.to_p(False, FailReason.ABORTED)]
    assert events(out) == [ev(RELEASED)]


# -- issue 11's foreign-peer findings, on the cores ------------------------------------------------------


def test_d_refuses_a_done_that_does_not_match_its_registration() -> None:
    t = D()
    t.start(0.0)
    bad = Done(num_blocks=5, **t._common(TID))  # type: ignore[arg-type]
    out = t.from_p(0.5, bad)
    # Not READY: FAILED (bad_done) then, as P's registration ended with it, RELEASED at once.
    assert events(out) == [ev(FAILED, FailReason.BAD_DONE), ev(RELEASED, FailReason.BAD_DONE)]
    assert t.core.stats.failures[FailReason.BAD_DONE] == 1


def test_p_answers_a_failed_from_d_in_push_as_a_cancel() -> None:
    t = P()
    t.registered(0.0)
    failed = Failed(
        transfer_id=TID,
        engine_id=t.d.engine_id,
        incarnation=t.d.incarnation,
        tp_rank=0,
        pp_rank=0,
        reason=FailReason.ABORTED,
    )
    out = t.from_d(0.25, failed)
    assert sent(out, CancelAck) == [t.cancel_ack(wrote=False).msg]
    assert t.core.stats.cancels == 1


def test_a_failed_with_a_reason_this_version_does_not_know_still_ends_the_rank() -> None:
    t = D()
    t.start(0.0)
    raw = bytearray(encode_notif(t.failed(FailReason.ABORTED)))
    raw = raw.replace(b"aborted", b"newcase")  # a newer peer's reason, same length
    assert decode_notif(bytes(raw)) == t.failed(FailReason.UNKNOWN)
    out = t.h.at(0.5, NotifIn((0, 0), t.p.agent(), bytes(raw)))
    assert events(out) == [ev(FAILED, FailReason.UNKNOWN), ev(RELEASED, FailReason.UNKNOWN)]
