"""A decode request D will not load (``Decline``), driven by hand: D tells each P rank it pairs with, and P
frees the prompt's blocks at once instead of at its lease. Whole vLLM schedulers: vllm_tests/test_decline.py;
under the simulator's faults: ``Faults.decline`` (tests/unit/test_sim.py)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvwire.core.base import DropReason, Refused
from kvwire.core.consumer_decline import MAX_DECLINES
from kvwire.core.events import ProducerOutcome
from kvwire.core.io import Decline, Emit, Finished, Send, StartHandshake
from kvwire.protocol.messages import Cancel, CancelAck, Failed, FailReason, TransferMode
from kvwire.testing.core_harness import events, one, only
from kvwire.testing.cores_env import BLOCKS, CFG, PULL, PUSH, TID, TOKENS, D, P, freed
from kvwire.transport.base import PeerMode


def _decline(t: D, tid: str = TID) -> Decline:
    return Decline(tid, t.allocated(tid).remote)


@pytest.mark.parametrize("mode", [PUSH, PULL], ids=["push", "pull"])
def test_d_tells_each_p_rank_it_pairs_with(mode: TransferMode) -> None:
    t = D(mode=mode)
    hs = one(t.h.at(0.0, _decline(t)), StartHandshake)
    want_mode = PeerMode.NOTIF_ONLY if mode is PUSH else PeerMode.FULL
    assert (hs.port, hs.remote, hs.mode, hs.engine_id) == (5000, (0, 0), want_mode, "P")
    told = one(t.h.done(0.0, hs.token, t.p.peer_rank(mode=want_mode)), Send)
    assert told.peer == t.p.agent() and told.msg.transfer_id == TID
    if mode is PUSH:
        assert isinstance(told.msg, Cancel)
    else:
        assert isinstance(told.msg, Failed) and told.msg.reason is FailReason.ABORTED
    assert t.core.live_requests == 0 and events(t.h.log) == []  # nothing of D's was involved
    assert t.core.stats.declined == 1
    if mode is PUSH:  # P acks the cancel: expected, not counted as a stray notification
        ack = CancelAck(
            transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, wrote=False
        )
        assert t.from_p(0.25, ack) == []


def test_d_tells_nothing_to_another_life_or_for_a_request_it_holds() -> None:
    t = D()
    older = msgspec.structs.replace(t.allocated().remote, incarnation="P-life0")  # P restarted since
    hs = one(t.h.at(0.0, Decline(TID, older)), StartHandshake)
    assert only(t.h.done(0.0, hs.token, t.p.peer_rank(mode=PeerMode.NOTIF_ONLY)), Send) == []
    # A failed handshake: nothing either (P's lease ends it).
    hs = one(t.h.at(0.0, _decline(t, "req-2")), StartHandshake)
    assert only(t.h.done(0.0, hs.token, None, "refused"), Send) == []
    # Allocated after all: the engine aborts it instead.
    t.start(0.5, "req-3")
    assert only(t.h.at(0.5, _decline(t, "req-3")), StartHandshake) == []
    assert t.core.stats.declined == 2  # the first two set out to tell P; the third did not


def test_declines_in_flight_are_bounded() -> None:
    t = D()
    for i in range(MAX_DECLINES + 5):
        t.h.at(0.0, _decline(t, f"req-{i}"))
    assert len(only(t.h.log, StartHandshake)) == MAX_DECLINES
    assert t.core._declines.dropped == 5


def test_p_frees_a_held_request_when_d_declines_it() -> None:
    t = P()
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    out = t.from_d(0.25, t.cancel())
    assert Emit(freed(ProducerOutcome.ABORTED)) in out and t.cancel_ack(wrote=False) in out
    assert t.core.live_requests == 0


def test_p_reports_a_prefill_ended_when_d_declined_it_before_it_finished() -> None:
    """kvwire's own engines send the decode leg with the prefill: D may give up before P finishes."""
    t = P()
    out = t.from_d(0.0, t.cancel())
    assert t.cancel_ack(wrote=False) in out and events(out) == []
    assert events(t.h.at(0.5, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.ABORTED)]
    with pytest.raises(Refused) as err:  # that D rank's push_reg, overtaken by its cancel
        t.from_d(0.75, t.push_reg())
    assert err.value.reason is DropReason.CANCELLED


def test_p_bounds_the_cancels_of_transfers_it_has_not_seen() -> None:
    """Each such cancel leaves a tombstone (a push_reg of that D rank must find it): per D life, no more
    than ``max_early_registrations_per_peer`` of them live at once."""
    t = P(dataclasses.replace(CFG, max_early_registrations_per_peer=2))
    for i in range(2):
        t.from_d(0.0, t.cancel(f"unseen-{i}"))
    with pytest.raises(Refused) as err:
        t.from_d(0.0, t.cancel("unseen-2"))
    assert err.value.reason is DropReason.OVERLOAD
