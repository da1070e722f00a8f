"""D's cores (push and pull) driven by hand in explicit time: every timed rule at its boundary, the cancel and
re-handshake paths, and the refusal of stray input. No threads, no sleeps, no agents: each test feeds
``(now, input)`` and asserts the exact actions and events that come back (``kvwire.testing.core_harness``).

Times are binary fractions (0.25, 5.125, ...) so that ``a + b`` lands exactly where the rule's boundary is;
the timers run at most every ``TIMER_PERIOD_S``, so two ticks that must both check are further apart than
that (``CoreHarness.ticks`` refuses a shorter step).
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvwire.core.base import DropReason, Refused
from kvwire.core.io import (
    Abort,
    Allocated,
    Emit,
    Finished,
    ForgetPeer,
    HandshakeDone,
    NotifIn,
    PostRead,
    Reap,
    Release,
    RemoteEngine,
    Send,
    SendClaim,
    StartHandshake,
    TouchPeer,
)
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import (
    Cancel,
    Done,
    FailReason,
    Heartbeat,
    PushReg,
    TransferMode,
)
from kvwire.testing.core_harness import TestEngine, events, one, only, protocol, sent
from kvwire.testing.cores_env import (
    BLOCKS,
    CFG,
    D_BLOCKS,
    FAILED,
    PULL,
    PUSH,
    READY,
    RELEASED,
    TID,
    TOKENS,
    D,
    P,
    ev,
)
from kvwire.transport.base import PeerMode


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
    a probe of who is at P's address now (returned, unanswered). The probe names no engine id: whoever
    answers there is news (a restarted engine usually has a new id, which a named one would refuse)."""
    assert protocol(t.h.ticks(5.0, 0.25)) == []
    out = protocol(t.h.tick(5.125))
    probe = one(out, StartHandshake)
    assert (probe.port, probe.remote, probe.mode, probe.engine_id) == (
        5000,
        (0, 0),
        PeerMode.NOTIF_ONLY,
        None,
    )
    assert out == [ForgetPeer("P", "P-life1"), probe, Emit(ev(FAILED, FailReason.PEER_DEAD)), t.cancel()]
    assert t.core.stats.peers_declared_dead == 1
    return probe


@pytest.mark.parametrize("answer", ["refused", "newer_life", "new_engine_id"])
def test_d_releases_a_dead_lifes_blocks_after_the_grace_when_its_address_confirms_it_gone(
    answer: str,
) -> None:
    t = D()
    t.start(0.0)
    probe = declared_dead(t)
    if answer == "refused":  # nobody listens: a killed process's socket is closed
        t.h.at(5.25, HandshakeDone(probe.token, None, "refused", nobody_listens=True))
    elif answer == "newer_life":
        t.h.done(5.25, probe.token, dataclasses.replace(t.p.peer_rank(), incarnation="P-life2"))
    else:  # restarted under a new engine id (kvwire serve's and vLLM's default), same address
        t.h.done(5.25, probe.token, dataclasses.replace(t.p.peer_rank(), engine_id="P2", incarnation="P2-l1"))
    # The grace runs from the confirmation too: a killed process's socket still sends what it queued.
    assert events(t.h.tick(6.125)) == []
    assert events(t.h.tick(6.25)) == [ev(RELEASED, FailReason.PEER_DEAD)]


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
    # Blocks stay fenced for dead_peer_grace_s after the verdict (a thawed P could still finish a write)
    # and after the word that confirms the life (what the kernels held may still drain into them).
    assert events(t.h.ticks(6.5 - 2**-5, 0.0625)) == []  # the last tick 31 ms before the grace ends
    assert events(t.h.tick(6.5)) == [ev(RELEASED, FailReason.PEER_DEAD)]
    assert t.push_core.quarantined() == 0 and t.core.live_requests == 0


def test_d_keeps_an_unconfirmed_dead_lifes_blocks_until_the_quarantine_bound() -> None:
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)
    declared_dead(t)
    assert events(t.h.ticks(10.125 - 2**-5, 0.25)) == [] and t.push_core.quarantined() == 1  # bound: 10.125
    assert events(t.h.tick(10.125)) == [ev(RELEASED, FailReason.PEER_DEAD)]
    assert t.core.stats.quarantine_expired == 1


@pytest.mark.parametrize("engine_id", ["P", "P2"])
def test_d_releases_a_dead_lifes_blocks_when_a_newer_life_answers(engine_id: str) -> None:
    t = D()
    t.start(0.0)
    probe = declared_dead(t)
    t.h.at(5.25, HandshakeDone(probe.token, None, "timed out"))  # the probe learnt nothing
    t.h.ticks(6.25, 0.25)
    # Another request handshakes with the restarted P at the same address: the old process is over,
    # whether the new life kept the engine id or (kvwire serve's and vLLM's default) took a new one.
    p2 = TestEngine.build(engine_id, incarnation=f"{engine_id}-life2", port=5000)
    hs = one(t.h.at(6.25, t.allocated("req-2")), StartHandshake)
    t.h.done(6.25, hs.token, p2.peer_rank(mode=PeerMode.NOTIF_ONLY))
    assert events(t.h.tick(7.0)) == []  # the grace, from the answer
    assert events(t.h.tick(7.25)) == [ev(RELEASED, FailReason.PEER_DEAD)]


@pytest.mark.parametrize("answer", ["P-life0", "Q"])
@pytest.mark.parametrize("when", ["before_the_verdict", "after_the_verdict"])
def test_a_cached_answer_of_another_life_confirms_nothing(answer: str, when: str) -> None:
    # One D rank's cache may still hold an older life of the address (an older incarnation of P, or the
    # engine Q that held the address before) after another rank loaded P-life1: that answer is no news
    # about P-life1, alive or frozen and declared dead, whose blocks must wait for a real confirmation.
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)  # req-1 on P-life1
    stale = dataclasses.replace(
        t.p.peer_rank(mode=PeerMode.NOTIF_ONLY), engine_id=answer[0], incarnation=answer
    )

    def stale_answer(now: float) -> None:
        remote = msgspec.structs.replace(t.allocated("req-2").remote, engine_id=answer[0])
        hs = one(t.h.at(now, msgspec.structs.replace(t.allocated("req-2"), remote=remote)), StartHandshake)
        t.h.done(now, hs.token, stale, cached=True)

    if when == "before_the_verdict":
        stale_answer(0.25)
    probe = declared_dead(t)  # P-life1, silent since 0
    t.h.at(5.25, HandshakeDone(probe.token, None, "timed out"))  # frozen: the probe learns nothing
    if when == "after_the_verdict":
        stale_answer(5.5)
    mine = [e for e in events(t.h.ticks(10.125 - 2**-5, 0.25)) if getattr(e, "transfer_id", "") == TID]
    assert ev(RELEASED, FailReason.PEER_DEAD) not in mine  # not at the grace (6.125 or 6.5): at the bound
    assert ev(RELEASED, FailReason.PEER_DEAD) in events(t.h.tick(10.125))


def test_a_fresh_answer_of_another_engine_at_the_address_confirms_a_dead_life_gone() -> None:
    # The same answer from the address itself (not a cache): another process holds it, P-life1 is over.
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)
    probe = declared_dead(t)
    t.h.at(5.25, HandshakeDone(probe.token, None, "timed out"))
    q = dataclasses.replace(t.p.peer_rank(mode=PeerMode.NOTIF_ONLY), engine_id="Q", incarnation="Q-1")
    remote = msgspec.structs.replace(t.allocated("req-2").remote, engine_id="Q")
    hs = one(t.h.at(5.5, msgspec.structs.replace(t.allocated("req-2"), remote=remote)), StartHandshake)
    t.h.done(5.5, hs.token, q)
    assert events(t.h.tick(6.375)) == []  # the grace, from the answer at 5.5
    assert ev(RELEASED, FailReason.PEER_DEAD) in events(t.h.tick(6.5))


def test_d_forgets_a_dead_lifes_liveness_once_no_request_waits_on_it() -> None:
    t = D()
    t.start(0.0)
    declared_dead(t)
    assert t.core.watched_peers() == [("P", "P-life1")]
    t.from_p(5.5, t.heartbeat())
    t.h.ticks(6.5, 0.125)
    assert t.core.live_requests == 0
    t.h.ticks(7.25, 0.125)  # pruned at the next heartbeat
    assert t.core.watched_peers() == []


def test_a_second_verdict_keeps_the_first_verdicts_confirmation() -> None:
    # A grace longer than the liveness timeout: the life is revived, confirmed, then declared dead again
    # while req-1 still waits out the grace from the word that confirmed its own verdict.
    t = D(dataclasses.replace(CFG, dead_peer_grace_s=7.0))
    t.start(0.0)
    declared_dead(t)  # verdict 1 at 5.125
    hs = one(t.h.at(5.25, t.allocated("req-2")), StartHandshake)
    t.h.done(5.25, hs.token, t.p.peer_rank(mode=PeerMode.NOTIF_ONLY))  # revived by a fresh handshake
    t.from_p(5.5, t.heartbeat())  # the word after verdict 1: req-1 may go at 12.5
    before = events(t.h.ticks(12.5 - 2**-5, 0.0625))
    assert ev(FAILED, FailReason.PEER_DEAD, tid="req-2") in before  # verdict 2: silent since 5.5
    assert ev(RELEASED, FailReason.PEER_DEAD) not in before
    assert ev(RELEASED, FailReason.PEER_DEAD) in events(t.h.tick(12.5))
    assert t.core.stats.quarantine_expired == 0  # confirmed, not released at the bound


def test_a_late_confirmation_does_not_hold_blocks_past_the_quarantine_bound() -> None:
    t = D(dataclasses.replace(CFG, dead_quarantine_s=4.0))
    t.start(0.0)
    declared_dead(t)  # verdict at 5.125: the bound is 5.125 + 1 + 4
    t.from_p(10.0, t.heartbeat())  # a word 0.125 s before the bound; a grace after it would be 11.0
    assert events(t.h.ticks(10.125 - 2**-5, 0.0625)) == []
    assert events(t.h.tick(10.125)) == [ev(RELEASED, FailReason.PEER_DEAD)]
    assert t.core.stats.quarantine_expired == 0


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
    assert events(t.h.tick(7.125)) == []  # P spoke at 6.25: req-1 goes a grace later
    assert events(t.h.tick(7.25)) == [ev(RELEASED, FailReason.PEER_DEAD)]


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
    assert events(out) == [ev(FAILED, FailReason.FENCE_EXPIRED)]
    assert sent(out) == []  # that rank ended: no cancel to it
    # P may have posted a write before its fence expired: the blocks wait the grace (test_fail_closed).
    assert events(t.h.tick(0.5 + CFG.dead_peer_grace_s)) == [ev(RELEASED, FailReason.FENCE_EXPIRED)]


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


def test_d_fails_a_request_whose_p_is_shaped_otherwise_than_it_says() -> None:
    """The request says P has no PP; P's rank answers as stage 0 of 2: failed at once, INCOMPATIBLE (not on
    P's first done, whose byte count holds one stage's layers only)."""
    p2 = TestEngine.build("P", pp=2, port=5000)
    t = D()
    hs = one(t.h.at(0.0, t.allocated()), StartHandshake)
    assert hs.remote == (0, 0)
    out = t.h.done(0.5, hs.token, p2.peer_rank((0, 0), PeerMode.NOTIF_ONLY))
    assert not any(isinstance(a, Send) for a in out)  # nothing registered with P
    assert events(out) == [ev(FAILED, FailReason.INCOMPATIBLE), ev(RELEASED, FailReason.INCOMPATIBLE)]


@pytest.mark.parametrize("mode", [PUSH, PULL])
def test_d_fails_a_request_whose_p_restarted_since_it_prefilled(mode: TransferMode) -> None:
    """P's answer named the life that prefilled (remote_incarnation); the handshake finds a newer life at
    that address, whose blocks hold none of this request's KV: failed at once (peer_dead), nothing read or
    registered. Without the check, pull READ the new life's blocks: READY with other bytes (the simulator,
    plant read-any-life)."""
    t = D(mode=mode)
    allocated = t.allocated()
    allocated = msgspec.structs.replace(
        allocated, remote=msgspec.structs.replace(allocated.remote, incarnation="P-life1")
    )
    hs = one(t.h.at(0.0, allocated), StartHandshake)
    newer = TestEngine.build("P", mode=mode, incarnation="P-life2", port=5000)
    peer_mode = PeerMode.NOTIF_ONLY if mode is PUSH else PeerMode.FULL
    out = t.h.done(0.5, hs.token, newer.peer_rank(mode=peer_mode))
    assert not any(isinstance(a, Send | PostRead | SendClaim) for a in out)
    assert events(out) == [ev(FAILED, FailReason.PEER_DEAD), ev(RELEASED, FailReason.PEER_DEAD)]
    same = D(mode=mode)  # the life that prefilled answers: served as before (pull claims the blocks first)
    hs = one(same.h.at(0.0, allocated), StartHandshake)
    out = same.h.done(0.5, hs.token, same.p.peer_rank(mode=peer_mode))
    assert any(isinstance(a, Send | SendClaim) for a in out) and not events(out)


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
    assert late.value.reason is DropReason.ENDED_TRANSFER  # told from a transfer D never registered


def test_d_with_two_p_ranks_waits_for_both_and_refuses_a_repeated_done() -> None:
    p2 = TestEngine.build("P", tp=2, port=5000)
    t = D()
    remote = RemoteEngine("P", "127.0.0.1", 5000, tp_size=2)
    hss = only(t.h.at(0.0, Allocated(TID, tuple(D_BLOCKS), TOKENS, 0, remote)), StartHandshake)
    assert [h.remote for h in hss] == [(0, 0), (0, 1)]
    nonces = {}
    for h in hss:
        reg = one(t.h.done(0.0, h.token, p2.peer_rank(h.remote, PeerMode.NOTIF_ONLY)), Send)
        assert reg.peer == p2.agent(h.remote) and isinstance(reg.msg, PushReg)
        nonces[h.remote[1]] = reg.msg.reg_nonce
    assert len(set(nonces.values())) == 2 and 0 not in nonces.values()  # one per registration
    spec = t.d.info.spec
    half = TOKENS * spec.num_layers * len(spec.kinds) * spec.head_bytes  # each P rank holds one of 2 heads

    def done(rank: int) -> NotifIn:
        msg = Done(
            transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=rank, pp_rank=0, num_blocks=2,
            reg_nonce=nonces[rank], nbytes=half,
        )  # fmt: skip
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
    assert out == [Release(rd.token), Emit(ev(FAILED, FailReason.WRITE_FAILED))]
    # What the failed read had under way may still drain into D's blocks: they wait the grace.
    assert protocol(t.h.ticks(0.5 + CFG.dead_peer_grace_s - 0.05, 0.1)) == []
    assert protocol(t.h.tick(0.5 + CFG.dead_peer_grace_s)) == [
        t.to_p(False, FailReason.WRITE_FAILED),  # no READ in flight any more: P may free its blocks
        Emit(ev(RELEASED, FailReason.WRITE_FAILED)),
    ]


def test_pull_read_timeout_releases_and_tells_p_failed() -> None:
    t = D(mode=PULL, cfg=dataclasses.replace(CFG, transfer_timeout_s=2.0))
    rd = one(t.start(0.0), PostRead)
    assert protocol(t.h.ticks(2.0, 0.25)) == []
    out = protocol(t.h.tick(2.125))
    assert out == [Release(rd.token), Emit(ev(FAILED, FailReason.TRANSFER_TIMEOUT))]
    assert protocol(t.h.ticks(2.125 + CFG.dead_peer_grace_s - 0.05, 0.1)) == []
    assert protocol(t.h.tick(2.125 + CFG.dead_peer_grace_s)) == [
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


def test_d_refuses_a_done_that_does_not_match_its_registration() -> None:
    t = D()
    t.start(0.0)
    bad = Done(num_blocks=5, **t._common(TID))  # type: ignore[arg-type]
    out = t.from_p(0.5, bad)
    # Not READY: FAILED (bad_done) then, as P's registration ended with it, RELEASED at once.
    assert events(out) == [ev(FAILED, FailReason.BAD_DONE), ev(RELEASED, FailReason.BAD_DONE)]
    assert t.core.stats.failures[FailReason.BAD_DONE] == 1


def test_a_failed_with_a_reason_this_version_does_not_know_still_ends_the_rank() -> None:
    t = D()
    t.start(0.0)
    raw = bytearray(encode_notif(t.failed(FailReason.ABORTED)))
    raw = raw.replace(b"aborted", b"newcase")  # a newer peer's reason, same length
    assert decode_notif(bytes(raw)) == t.failed(FailReason.UNKNOWN)
    out = t.h.at(0.5, NotifIn((0, 0), t.p.agent(), bytes(raw)))
    assert events(out) == [ev(FAILED, FailReason.UNKNOWN)]
    # An unknown reason may follow a write: the blocks wait the grace, as for any posted write.
    assert events(t.h.tick(0.5 + CFG.dead_peer_grace_s)) == [ev(RELEASED, FailReason.UNKNOWN)]


def test_ps_first_word_after_a_silence_touches_it() -> None:
    """A done (or any word) from a P life silent for a heartbeat period: ``TouchPeer`` closes a circuit a
    partition tripped for that P (core/breaker.py). A done right after P's last word does not."""
    t = D()
    t.start(0.0)
    assert TouchPeer("P") in t.from_p(2.0, t.done())
    quick = D()
    quick.start(0.0)
    quick.from_p(0.5, quick.heartbeat())
    assert TouchPeer("P") not in quick.from_p(0.75, quick.done())


def test_d_splits_a_live_set_longer_than_a_heartbeat_carries() -> None:
    from kvwire.protocol.limits import MAX_HEARTBEAT_IDS

    t = D(dataclasses.replace(CFG, liveness_timeout_s=50.0))
    tids = [f"r{i}" for i in range(MAX_HEARTBEAT_IDS + 3)]
    for tid in tids:
        t.start(0.0, tid)
    beats = sent(t.h.ticks(1.0, 0.25), Heartbeat)
    assert sorted(len(b.transfer_ids) for b in beats) == [3, MAX_HEARTBEAT_IDS]
    assert sorted(t for b in beats for t in b.transfer_ids) == sorted(tids)


def _p_heartbeat(*tids: str) -> Heartbeat:
    return Heartbeat(transfer_id="", engine_id="P", incarnation="P-life1", transfer_ids=list(tids))


def test_a_registration_p_stopped_naming_fails_while_p_lives_on() -> None:
    """r1's done is lost; P lives on, serving r2, and its heartbeats name r2 only. Liveness never ends r1
    (P speaks every second): before, r1 held its blocks for as long as P had other work with D. Now it fails
    once P has not named it for longer than P's handshake with D can take, and its blocks wait the grace."""
    t = D()
    cfg = t.core.config
    window = max(cfg.handshake_timeout_s * (cfg.handshake_retries + 1), cfg.transfer_timeout_s)
    window += cfg.liveness_timeout_s + 2 * cfg.heartbeat_interval_s
    t.start(0.0, "r1")
    t.start(0.0, "r2")
    second, failed_at = 0.0, None
    while failed_at is None:
        second += 1.0
        assert second < window + 3, "r1 never failed"
        t.from_p(second, _p_heartbeat("r2"))  # r1's done (and every word after it) never came
        for step in range(1, 20):
            got = events(t.h.tick(second + step * 0.05))
            if got:
                assert got == [ev(FAILED, FailReason.TRANSFER_TIMEOUT, "r1")]
                failed_at = second + step * 0.05
                break
    assert window < failed_at <= window + 2
    assert events(t.h.ticks(failed_at + cfg.dead_peer_grace_s - 0.1, 0.05)) == []  # the grace
    assert events(t.h.ticks(failed_at + cfg.dead_peer_grace_s + 0.1, 0.05)) == [
        ev(RELEASED, FailReason.TRANSFER_TIMEOUT, "r1")
    ]
    assert events(t.from_p(second + 2, t.done("r2"))) == [ev(READY, tid="r2")]  # r2 was never touched
    assert t.core.stats.peers_declared_dead == 0


def test_a_registration_p_keeps_naming_waits_past_that_window() -> None:
    t = D()  # the window: 27 s
    t.start(0.0, "r1")
    for second in range(1, 60):  # a minute of prefill: P names r1 in every heartbeat
        assert events(t.from_p(float(second), _p_heartbeat("r1")) + t.h.ticks(second + 0.5, 0.25)) == []
    assert events(t.from_p(60.0, t.done("r1"))) == [ev(READY, tid="r1")]
