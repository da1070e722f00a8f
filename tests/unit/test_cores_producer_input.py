"""P's cores (push and pull) against hostile and stray input, driven by hand in explicit time: bad block ids,
malformed and misattributed notifications, the bounds on early registrations and tombstones, the pull
producer's lease, and the documented ``num_blocks`` rule (``kvwire.testing.core_harness``).

Split from ``test_cores_producer.py`` (the timed rules), which holds the module's conventions.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgspec
import pytest

from kvwire.core.base import DropReason, Refused
from kvwire.core.events import ProducerOutcome
from kvwire.core.io import (
    Abort,
    Finished,
    NotifIn,
    PostWrite,
    ReportFailure,
    StartHandshake,
    TouchPeer,
)
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import (
    CancelAck,
    Done,
    Failed,
    FailReason,
)
from kvwire.testing.core_harness import TestEngine, events, one, sent
from kvwire.testing.cores_env import BLOCKS, CFG, PULL, PUSH, TID, TOKENS, P, freed
from kvwire.transport.base import PeerMode


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
    # Overload: dropped (counted), and D told on its side channel (it would wait for its liveness).
    over = t.from_d(0.0, t.push_reg("req-2"))
    assert len(over) == 1 and isinstance(over[0], ReportFailure)
    assert over[0].failed.reason is FailReason.OVERLOADED and over[0].failed.transfer_id == "req-2"
    assert t.core.stats.dropped_notifs["overload"] == 1
    done = Done(transfer_id=TID, engine_id="D", incarnation="D-life1", tp_rank=0, pp_rank=0, num_blocks=2)
    with pytest.raises(Refused) as unexpected:
        t.from_d(0.0, done)
    with pytest.raises(Refused) as unseen:  # a cancel of a transfer not seen needs an early record too
        t.from_d(0.0, t.cancel("req-3"))
    reasons = [e.value.reason for e in (dup, unexpected, unseen)]
    assert reasons == [DropReason.DUPLICATE, DropReason.UNEXPECTED, DropReason.OVERLOAD]
    assert t.core.registrations(TID) == 1 and t.core.registrations("req-2") == 0
    assert t.core.early_registrations == 1


def test_one_d_life_holds_at_most_its_share_of_the_early_registrations() -> None:
    """A peer that fills its share (max_early_registrations_per_peer) is refused as overloaded; another D
    life still registers; a slot comes back when one of its requests leaves the prefill."""
    t = P(dataclasses.replace(CFG, max_early_registrations=8, max_early_registrations_per_peer=2))
    d2 = TestEngine.build("D2", mode=PUSH, port=6001)
    for tid in ("a1", "a2"):
        one(t.from_d(0.0, t.push_reg(tid)), StartHandshake)
    over = t.from_d(0.0, t.push_reg("a3"))
    assert [type(a) for a in over] == [ReportFailure] and over[0].failed.reason is FailReason.OVERLOADED
    other = msgspec.structs.replace(t.push_reg("b1"), engine_id=d2.engine_id, incarnation=d2.incarnation)
    one(t.h.at(0.0, d2.notif(other)), StartHandshake)
    assert t.core.early_registrations == 3
    t.h.at(0.1, Finished("a1", BLOCKS, TOKENS))  # a1 leaves the prefill: D's share has room again
    one(t.from_d(0.2, t.push_reg("a3")), StartHandshake)
    assert t.core.stats.dropped_notifs["overload"] == 1


def test_the_early_registrations_are_bounded_in_block_ids_too() -> None:
    """4,096 early registrations of a 4 MiB push_reg each (~800k block ids, ~30 MB decoded) were within the
    count bounds: the ids they name are bounded too (+1 per registration), and come back when a request
    leaves the prefill."""
    t = P(dataclasses.replace(CFG, max_early_block_ids=250))
    big = list(range(100))
    for tid in ("a1", "a2"):  # 101 each: 202 of 250
        one(t.from_d(0.0, t.push_reg(tid, blocks=big)), StartHandshake)
    over = t.from_d(0.0, t.push_reg("a3", blocks=big))
    assert [type(a) for a in over] == [ReportFailure] and over[0].failed.reason is FailReason.OVERLOADED
    one(t.from_d(0.0, t.push_reg("a4", blocks=[0, 1])), StartHandshake)  # a small one still fits: 205
    t.h.at(0.1, Finished("a1", BLOCKS, TOKENS))  # a1 leaves the prefill: its 101 come back
    one(t.from_d(0.2, t.push_reg("a3", blocks=big)), StartHandshake)
    assert t.core.stats.dropped_notifs["overload"] == 1 and t.core.early_registrations == 3


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


def _documented_num_blocks_rule() -> str:
    """The formula docs/protocol.md's notification table gives for a push ``done``'s ``num_blocks``."""
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `done` |"))
    found = re.search(r"`num_blocks`[^`]*push[^`]*`([^`]+)`", row)
    assert found is not None, f"the done row states no num_blocks rule: {row}"
    return found.group(1)


def test_the_documented_num_blocks_rule_is_the_one_p_writes() -> None:
    """The table said ``num_blocks`` (blocks written) while the text, and D's check, say D's blocks past
    its prefix hit; the two differ whenever P's block size or TP size differs from D's."""
    t = P()
    reg = msgspec.structs.replace(t.push_reg(), num_cached_tokens=4)
    hs = one(t.from_d(0.0, reg), StartHandshake)
    t.h.done(0.0, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
    w = one(t.h.at(0.0, Finished(TID, BLOCKS, TOKENS)), PostWrite)
    done = decode_notif(w.notif)
    assert isinstance(done, Done)
    names = {"len": len, "block_ids": reg.block_ids, "num_cached_tokens": reg.num_cached_tokens}
    names["block_size"] = t.d.info.spec.block_size
    rule = _documented_num_blocks_rule()
    assert done.num_blocks == eval(rule, {"__builtins__": {}}, names) == 1, rule


def test_ds_first_word_after_a_silence_touches_it_and_later_words_do_not() -> None:
    """A push_reg (or cancel) from a D that said nothing for a heartbeat period is a sign of life: the
    ``TouchPeer`` closes a circuit a partition tripped for D (core/breaker.py); words in a stream do not."""
    t = P()
    assert t.from_d(0.0, t.push_reg())[0] == TouchPeer("D")
    assert TouchPeer("D") not in t.from_d(0.5, t.cancel())  # in the stream: no touch
    later = P()
    later.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert later.from_d(2.0, later.push_reg())[0] == TouchPeer("D")


def test_tombstones_are_bounded_and_keep_none_of_ds_block_ids() -> None:
    """A flood of push_regs with a 1 ms fence ends a request per push_reg, each a tombstone for 60 s: their
    number had no bound (12,288 entries after 12,288 push_regs, whatever max_early_registrations), and each
    kept the push_reg's block ids. Past max_tombstones the oldest go, and a tombstone keeps no block id."""
    t = P(dataclasses.replace(CFG, max_tombstones=8))
    for i in range(20):
        t.from_d(i * 0.01, t.push_reg(f"flood{i}", fence_ms=1, blocks=list(range(100))))
    t.h.ticks(1.0, 0.1)  # every fence expired: each request ended
    core = t.core
    assert core.live_requests == 0 and core.registrations("flood19") == 1
    assert len(core._requests) == 8 and core.stats.tombstones_dropped == 12
    assert core.registrations("flood0") == 0  # the oldest went first
    assert all(not reg.msg.block_ids for req in core._requests.values() for reg in req.regs.values())


def _forged(t: P, i: int, blocks: list[int]) -> NotifIn:
    """A push_reg from a D life of its own (a sender without a secret can declare any)."""
    reg = msgspec.structs.replace(t.push_reg(), incarnation=f"forged{i}", block_ids=blocks)
    return NotifIn((0, 0), f"D/forged{i}/pp0/tp0", encode_notif(reg))


def test_registrations_of_a_held_or_ended_request_are_bounded_and_ended_ones_keep_no_block_ids() -> None:
    """The early bounds applied only to requests not finished here: 5,000 push_regs from as many declared
    D lives on one held request were 5,000 registrations (each a handshake), and one that failed or found
    a tombstone kept its block ids. One request now holds ``max_registrations_per_request``, more are
    dropped as ``overload``; an ended registration keeps none of D's ids."""
    t = P(dataclasses.replace(CFG, max_registrations_per_request=4))
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))  # held
    started = [
        a for i in range(10) for a in t.h.at(0.01 * i, _forged(t, i, [0, 1])) if isinstance(a, StartHandshake)
    ]
    assert len(started) == 4 and t.core.registrations(TID) == 4
    assert t.core.stats.dropped_notifs["overload"] == 6 and t.core.records == (4, 0, 8)
    # The forged lives' handshakes fail (D's address answers with its own life): no block id is kept.
    for hs in started:
        t.h.done(0.5, hs.token, None, "not that life")
    regs = t.core._requests[TID].regs.values()
    assert all(reg.msg.block_ids == [] for reg in regs)
    assert t.core.records == t.core.recount() == (4, 4, 0)  # every D rank's ended: a tombstone now
    tomb = P()
    tomb.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    tomb.h.at(0.0, Abort(TID))
    one(tomb.h.at(0.1, _forged(tomb, 0, list(range(100)))), StartHandshake)
    assert [reg.msg.block_ids for reg in tomb.core._requests[TID].regs.values()] == [[]]
    assert tomb.core.records == tomb.core.recount() == (1, 1, 0)


def test_registrations_of_a_held_request_are_bounded_in_block_ids_too() -> None:
    """While their handshakes wait (an address that never answers: ~20 s), registrations of a held request
    kept every id they named, unbounded: 256 push_regs of 200k ids each held 51M ids (+398 MiB)."""
    t = P(dataclasses.replace(CFG, max_block_ids=250))
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))  # held
    for i in range(2):  # 100 ids each: 200 of 250
        one(t.h.at(0.0, _forged(t, i, list(range(100)))), StartHandshake)
    over = t.h.at(0.0, _forged(t, 2, list(range(100))))
    assert [type(a) for a in over] == [TouchPeer, ReportFailure] and over[
        1
    ].failed.reason is FailReason.OVERLOADED
    assert t.core.records == t.core.recount() == (2, 0, 200)


def test_cancels_for_a_request_p_knows_are_bounded_like_registrations() -> None:
    """A cancel from a D agent without a registration is remembered (so its push_reg is refused later) and
    acked: 20,000 cancels from made-up lives kept 20,000 entries (19.6 MiB of names) and sent as many
    acks. They now count against ``max_registrations_per_request`` and ``max_registrations``."""
    t = P(dataclasses.replace(CFG, max_registrations_per_request=3))
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    acked = 0
    for i in range(5):
        cancel = msgspec.structs.replace(t.cancel(), incarnation=f"forged{i}")
        try:
            acked += len(
                sent(t.h.at(0.0, NotifIn((0, 0), f"D/forged{i}/pp0/tp0", encode_notif(cancel))), CancelAck)
            )
        except Refused as exc:
            assert exc.reason is DropReason.OVERLOAD
    # The first cancel ended the request (D gave it up before registering): the others went to its
    # tombstone, bounded the same.
    assert acked == 3 and t.core.records == t.core.recount() == (3, 3, 0)


def test_past_max_registrations_the_oldest_tombstones_holding_records_make_room() -> None:
    t = P(dataclasses.replace(CFG, max_registrations=3))
    t.h.at(0.0, Abort("bare"))  # a tombstone holding nothing: forgetting it frees nothing
    for tid in ("a1", "a2", "a3"):  # three registrations, each request then ended (a tombstone)
        one(t.from_d(0.0, t.push_reg(tid)), StartHandshake)
        t.h.at(0.0, Abort(tid))
    assert t.core.records == (3, 3, 0)
    one(t.from_d(0.1, t.push_reg("a4")), StartHandshake)  # the oldest tombstone holding one went
    assert t.core.registrations("a1") == 0 and t.core.registrations("a4") == 1
    assert t.core.records == t.core.recount() == (3, 2, 2) and t.core.stats.tombstones_dropped == 1
    assert "bare" in t.core._requests
    # A push_reg naming the oldest such tombstone when the table is full: that tombstone may go first, and
    # the push_reg is then an early registration, under the early bounds.
    early = P(dataclasses.replace(CFG, max_registrations=2, max_early_registrations=1))
    for tid in ("b1", "b2"):
        one(early.from_d(0.0, early.push_reg(tid)), StartHandshake)
        early.h.at(0.0, Abort(tid))
    one(early.from_d(0.1, early.push_reg("b1")), StartHandshake)  # b1 forgotten, then registered anew
    over = early.from_d(0.1, early.push_reg("b2"))  # the early table is full now
    assert [type(a) for a in over] == [ReportFailure]
    assert early.core.early_registrations == 1 and early.core.records == early.core.recount()


def test_live_registrations_filling_the_table_forget_no_tombstone() -> None:
    held = P(dataclasses.replace(CFG, max_registrations=1))
    held.h.at(0.0, Abort("ended"))
    held.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    one(held.from_d(0.0, held.push_reg()), StartHandshake)
    over = held.from_d(0.0, held.push_reg("req-2"))  # nothing forgettable frees room: refused, D told
    assert [type(a) for a in over] == [ReportFailure] and over[0].failed.reason is FailReason.OVERLOADED
    assert "ended" in held.core._requests and held.core.stats.tombstones_dropped == 0
