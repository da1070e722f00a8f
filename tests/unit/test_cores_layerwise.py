"""P's layer-wise push core, by hand in explicit time: each layer written as soon as it is computed, the
one ``done`` only on the last write after every other write ended, a ``push_reg`` arriving mid-prefill,
and the failure, cancel, abort, dead-D and fence paths ending the registration cleanly.

The test engine has two layers (0 and 1), K and V per layer, two blocks per request (``cores_env``)."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from kvwire.core.events import ProducerOutcome
from kvwire.core.io import (
    Abort,
    Action,
    Digest,
    Finished,
    LayersReady,
    PostWrite,
    Release,
    StartHandshake,
    StepEnded,
)
from kvwire.core.producer_layers import LayerwisePushProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.errors import LayoutError
from kvwire.protocol.codec import decode_notif
from kvwire.protocol.messages import CancelAck, Done, Failed, FailReason
from kvwire.testing.core_harness import CoreHarness, events, one, only, protocol, sent
from kvwire.testing.cores_env import BLOCKS, CFG, TID, TOKENS, P, freed
from kvwire.transport.base import PeerMode


class LP(P):
    """``P`` with the layer-wise core."""

    def __init__(self, **kw: object) -> None:
        super().__init__(dataclasses.replace(CFG, layerwise=True, **kw))  # type: ignore[arg-type]
        self.core = LayerwisePushProducerCore(
            self.p.info, self.p.layouts, self.p.num_blocks, self.core.config
        )
        self.h = CoreHarness(self.core)

    def layers(self, now: float, *layers: int, tid: str = TID) -> list[Action]:
        return self.h.at(now, LayersReady(tid, BLOCKS, TOKENS, layers))


def rows(w: PostWrite) -> set[tuple[int, ...]]:
    return {tuple(r) for r in np.concatenate([w.src, w.dst], axis=1).tolist()}


def layer_of(t: P, w: PostWrite) -> set[int]:
    """The layers whose D regions the write's destination rows fall in."""
    regions = t.d.layouts[(0, 0)].regions
    out = set()
    for addr, _n, _dev in w.dst.tolist():
        out |= {r.layer for r in regions if r.base_addr <= addr < r.base_addr + r.block_len * r.num_blocks}
    return out


def whole_request_write(t: P) -> PostWrite:
    """What whole-request push posts for the same request between the same two engines."""
    saved = t.core, t.h
    t.core = PushProducerCore(t.p.info, t.p.layouts, t.p.num_blocks, CFG)
    t.h = CoreHarness(t.core)
    try:
        return t.writing(0.0)
    finally:
        t.core, t.h = saved


def test_layerwise_writes_each_layer_when_ready_and_done_only_with_the_last() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    assert w0.notif is None and layer_of(t, w0) == {0}
    assert t.layers(0.25, 1) == []  # the last layer carries done: it waits for layer 0's write
    w1 = one(t.h.ended(0.375, w0.token), PostWrite)
    assert layer_of(t, w1) == {1} and w1.notif is not None
    whole = whole_request_write(t)
    # Same bytes as the whole-request write, split in two; the done states the same payload.
    assert rows(w0) | rows(w1) == rows(whole) and not rows(w0) & rows(w1)
    assert w0.nbytes + w1.nbytes == whole.nbytes
    assert decode_notif(w1.notif) == decode_notif(whole.notif)
    out = t.h.ended(0.5, w1.token)
    assert out == [Release(w1.token)]  # written; the blocks are the engine's until Finished
    assert events(t.h.at(0.625, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.SENT)]
    assert t.core.live_requests == 0 and t.core.stats.transfers_done == 1
    assert t.core.stats.bytes_moved == whole.nbytes


def test_layerwise_push_reg_mid_prefill_gets_the_ready_layers_at_once() -> None:
    t = LP()
    assert t.layers(0.0, 0) == []  # no push_reg yet: queued
    hs = one(t.from_d(0.125, t.push_reg()), StartHandshake)
    w0 = one(t.h.done(0.25, hs.token, t.d.peer_rank(mode=PeerMode.FULL)), PostWrite)
    assert layer_of(t, w0) == {0} and w0.notif is None
    t.h.ended(0.375, w0.token)
    w1 = one(t.layers(0.5, 1), PostWrite)
    assert layer_of(t, w1) == {1} and isinstance(decode_notif(w1.notif or b""), Done)
    t.h.ended(0.625, w1.token)
    assert events(t.h.at(0.75, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.SENT)]


def test_layerwise_push_reg_after_finished_is_one_write_with_done() -> None:
    t = LP()
    t.layers(0.0, 0)
    t.layers(0.0625, 1)
    assert t.h.at(0.125, Finished(TID, BLOCKS, TOKENS)) == []
    hs = one(t.from_d(0.25, t.push_reg()), StartHandshake)
    w = one(t.h.done(0.25, hs.token, t.d.peer_rank(mode=PeerMode.FULL)), PostWrite)
    assert rows(w) == rows(whole_request_write(t)) and w.notif is not None
    assert events(t.h.ended(0.375, w.token)) == [freed(ProducerOutcome.SENT)]


def test_layerwise_failed_layer_write_fails_the_request_cleanly() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    assert t.layers(0.25, 1) == []
    out = t.h.ended(0.375, w0.token, ok=False, detail="ucx error")
    assert out == [Release(w0.token), t.failed(FailReason.WRITE_FAILED)]  # no further layer is posted
    out = t.h.at(0.5, Finished(TID, BLOCKS, TOKENS))
    assert only(out, PostWrite) == [] and events(out) == [freed(ProducerOutcome.FAILED)]


def test_layerwise_refused_post_releases_the_layers_in_flight() -> None:
    t = LP()
    t.registered(0.0)
    t.h.accept = lambda a: not (isinstance(a, PostWrite) and a.notif is not None)
    w0 = one(t.layers(0.125, 0), PostWrite)
    out = t.h.ended(0.25, w0.token)
    assert out == [Release(w0.token)]  # ok; layer 1 not computed yet
    out = t.layers(0.375, 1)  # the final write's post is refused
    w1 = one(out, PostWrite)
    assert protocol(out) == [w1, t.failed(FailReason.POST_FAILED)]
    assert events(t.h.at(0.5, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.FAILED)]


def test_layerwise_cancel_between_layers_is_acked_at_once_and_stops_the_writes() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    assert t.from_d(0.25, t.cancel()) == []  # layer 0's write is in flight
    out = t.h.ended(0.375, w0.token)
    assert out == [Release(w0.token), t.cancel_ack(wrote=True)]
    assert only(t.layers(0.5, 1), PostWrite) == []
    assert events(t.h.at(0.625, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.ABORTED)]


def test_layerwise_cancel_while_the_last_write_is_in_flight_ends_with_its_done() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    t.layers(0.25, 1)
    w1 = one(t.h.ended(0.375, w0.token), PostWrite)
    assert t.from_d(0.5, t.cancel()) == []
    out = t.h.ended(0.625, w1.token)
    assert out == [Release(w1.token)] and sent(out, CancelAck) == []  # the done was its one answer


def test_layerwise_engine_abort_mid_layers_answers_aborted_after_the_write_in_flight() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    assert protocol(t.h.at(0.25, Abort(TID))) == []  # layer 0's write is in flight: it ends first
    out = t.h.ended(0.375, w0.token)
    assert out == [Release(w0.token), t.failed(FailReason.ABORTED)]
    assert only(t.layers(0.5, 1), PostWrite) == []
    assert t.core.live_requests == 0


def test_layerwise_dead_d_between_layers_fails_the_registration() -> None:
    t = LP(transfer_timeout_s=60.0, fence_ms=30_000)
    t.registered(0.0, fence_ms=30_000)
    w0 = one(t.layers(0.125, 0), PostWrite)
    t.h.ended(0.25, w0.token)
    assert t.failed(FailReason.PEER_DEAD) not in t.h.ticks(5.0, 0.25)  # silent since 0.0: dead after 5 s
    out = protocol(t.h.tick(5.0625))
    assert t.failed(FailReason.PEER_DEAD) in out
    assert only(t.layers(5.125, 1), PostWrite) == []
    assert events(t.h.at(5.25, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.FAILED)]


def test_layerwise_fence_stops_further_layers() -> None:
    t = LP()
    t.registered(0.0)  # fence 2 s
    w0 = one(t.layers(0.125, 0), PostWrite)
    t.h.ended(0.25, w0.token)
    out = t.layers(2.125, 1)
    assert only(out, PostWrite) == [] and sent(out, Failed) == [t.failed(FailReason.FENCE_EXPIRED).msg]


def test_layerwise_digest_covers_every_layer_and_rides_the_last_write() -> None:
    t = LP()
    t.h.digest = lambda action: b"\x01\x02\x03\x04"
    hs = one(t.from_d(0.0, msgspec.structs.replace(t.push_reg(), want_digest=True)), StartHandshake)
    t.h.done(0.0, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
    w0 = one(t.layers(0.125, 0), PostWrite)
    t.h.ended(0.25, w0.token)
    out = t.layers(0.375, 1)
    dg, w1 = one(out, Digest), one(out, PostWrite)
    assert dg.scope.layers == range(0, 2) and dg.scope.block_ids == BLOCKS
    done = decode_notif(w1.notif or b"")
    assert isinstance(done, Done) and done.digest == b"\x01\x02\x03\x04"


def test_layerwise_finished_without_layers_is_the_whole_request_write() -> None:
    t = LP()
    w = t.writing(0.0)
    whole = whole_request_write(t)
    assert rows(w) == rows(whole) and w.notif == whole.notif


def test_layerwise_after_the_step_ended_nothing_is_written_before_finished() -> None:
    """Between the engine's step and its Finished the engine may reuse the blocks (a request that does
    not finish): a push_reg arriving then gets its write only with Finished."""
    t = LP()
    t.layers(0.0, 0)
    t.layers(0.0625, 1)
    assert t.h.at(0.125, StepEnded(TID)) == []
    hs = one(t.from_d(0.25, t.push_reg()), StartHandshake)
    assert only(t.h.done(0.25, hs.token, t.d.peer_rank(mode=PeerMode.FULL)), PostWrite) == []
    w = one(t.h.at(0.375, Finished(TID, BLOCKS, TOKENS)), PostWrite)
    assert rows(w) == rows(whole_request_write(t))


def test_layerwise_step_ended_with_a_write_in_flight_releases_it_and_fails() -> None:
    t = LP()
    t.registered(0.0)
    w0 = one(t.layers(0.125, 0), PostWrite)
    assert t.core.streaming({TID}) and not t.core.streaming({"other"})
    out = t.h.at(0.25, StepEnded(TID))
    assert out == [Release(w0.token), t.failed(FailReason.TRANSFER_TIMEOUT)]
    assert not t.core.streaming({TID})
    assert events(t.h.at(0.375, Finished(TID, BLOCKS, TOKENS))) == [freed(ProducerOutcome.FAILED)]


def test_layerwise_layers_reported_after_their_step_ended_wait_for_finished() -> None:
    """A late GPU fence reports every layer of a step after ``StepEnded``: the step-over was dropped (no
    stream yet), and the layers went, the last with ``done``, before Finished, from blocks the engine no
    longer protects (D READY on them; an abort then freed them)."""
    t = LP()
    t.registered(0.0)
    assert t.h.at(0.125, StepEnded(TID)) == []
    assert only(t.layers(0.25, 0, 1), PostWrite) == []
    w = one(t.h.at(0.375, Finished(TID, BLOCKS, TOKENS)), PostWrite)
    assert rows(w) == rows(whole_request_write(t))


def test_layerwise_refuses_a_hybrid_model() -> None:
    """Lanes cut a plan into equal layer-major rows; a hybrid model's plan is per KV cache group, so a
    lane posted rows of layers not computed yet (D READY with stale KV)."""
    spec = dataclasses.replace(LP().p.info.spec, layer_groups=(0, 1), group_windows=(0, 8))
    t = LP()
    info = dataclasses.replace(t.p.info, spec=spec)
    with pytest.raises(LayoutError, match="hybrid"):
        LayerwisePushProducerCore(info, t.p.layouts, t.p.num_blocks, t.core.config)
