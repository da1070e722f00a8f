"""Connector failure paths on the in-process backend: failed writes, a cancel before any write, P's abort,
bad notifications. Fences, timeouts and dead peers are pinned in virtual time in
``test_cores_producer.py`` and ``test_cores_consumer.py``."""

from __future__ import annotations

import logging
import socket
import threading

import msgspec
import pytest

from kvwire.connector import ConnectorConfig, ConsumerEventKind, Producer, ProducerOutcome
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import FailReason, PushReg
from kvwire.testing.connector_env import Pair, wait_for
from kvwire.testing.engines import build_engine, untouched_blocks_zero

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
K = ConsumerEventKind


def _kinds(events: list) -> list[tuple[ConsumerEventKind, FailReason | None]]:  # type: ignore[type-arg]
    return [(e.kind, e.reason) for e in events]


def test_failed_write_is_reported_at_once() -> None:
    pair = Pair(SPEC)
    try:
        pair.p_agent().faults.fail_transfers = 1
        pair.consumer.request_allocated("fw", [0, 1], 8, 0, pair.remote())
        pair.producer.request_finished("fw", [2, 3], 8)
        assert _kinds(pair.d_event("fw")) == [
            (K.FAILED, FailReason.WRITE_FAILED),
            (K.RELEASED, FailReason.WRITE_FAILED),
        ]
        assert pair.p_event("fw").outcome is ProducerOutcome.FAILED
        assert pair.producer.stats.failures[FailReason.WRITE_FAILED] == 1
    finally:
        pair.close()


def test_cancel_before_prefill_end_gets_ack_and_no_write() -> None:
    pair = Pair(SPEC)
    try:
        pair.consumer.request_allocated("c1", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: pair.consumer.stats.transfers_started, "push_reg sent")
        pair.consumer.abort("c1")
        assert _kinds(pair.d_event("c1")) == [(K.RELEASED, None)]
        pair.fill_p([2, 3], 8)
        pair.producer.request_finished("c1", [2, 3], 8)
        assert pair.p_event("c1").outcome is ProducerOutcome.ABORTED
        assert pair.producer.stats.transfers_started == 0
        assert untouched_blocks_zero(pair.d.ranks, [])
    finally:
        pair.close()


def test_producer_abort_fails_the_registration() -> None:
    pair = Pair(SPEC)
    try:
        pair.consumer.request_allocated("pa", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: pair.consumer.stats.transfers_started, "push_reg sent")
        pair.producer.abort("pa")
        assert _kinds(pair.d_event("pa")) == [
            (K.FAILED, FailReason.ABORTED),
            (K.RELEASED, FailReason.ABORTED),
        ]
    finally:
        pair.close()


def test_bad_notifications_are_counted_and_dropped() -> None:
    pair = Pair(SPEC)
    try:
        p_agent = pair.p_agent()
        rogue = pair.fabric.create_agent("rogue/x1/pp0/tp0")
        rogue.add_peer(p_agent.conn_metadata())
        rogue.send_notif(p_agent.name, b"KVW1\xff\x00junk")
        rogue.send_notif(p_agent.name, b"nope")
        # Well formed, but it claims to come from another engine than the agent that sent it.
        fake = PushReg(
            transfer_id="t",
            engine_id="d-other",
            incarnation="i",
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=1,
            block_ids=[0],
            num_tokens=4,
        )
        rogue.send_notif(p_agent.name, encode_notif(fake))
        dropped = pair.producer.stats.dropped_notifs
        wait_for(lambda: sum(dropped.values()) == 3, "three drops")
        assert dropped["malformed"] == 2 and dropped["wrong_sender"] == 1
        # The connector still works.
        pair.consumer.request_allocated("ok", [0], 4, 0, pair.remote())
        pair.producer.request_finished("ok", [1], 4)
        assert _kinds(pair.d_event("ok")) == [(K.READY, None)]
    finally:
        pair.close()


def test_a_request_naming_a_p_replaced_at_its_address_fails_peer_dead_then_one_naming_it_is_served() -> None:
    # A P restarted under a new engine id (kvwire serve's and vLLM's default): a decode leg naming the old
    # id finds another engine at the address. It fails peer_dead (P's KV is gone; a retry may cure it),
    # not incompatible (a misconfiguration the engine answers with x-should-retry: false). Through the
    # real handshake manager, side channel and consumer core.
    pair = Pair(SPEC)
    try:
        old = msgspec.structs.replace(pair.remote(), engine_id="prefill-before-restart")
        pair.consumer.request_allocated("gone", [0], 4, 0, old)
        assert _kinds(pair.d_event("gone")) == [
            (K.FAILED, FailReason.PEER_DEAD),
            (K.RELEASED, FailReason.PEER_DEAD),
        ]
        # The engine that is there serves the next request as usual.
        pair.consumer.request_allocated("ok", [1], 4, 0, pair.remote())
        pair.producer.request_finished("ok", [2], 4)
        assert _kinds(pair.d_event("ok")) == [(K.READY, None)]
    finally:
        pair.close()


def test_layer_writes_that_fail_together_end_once_each(caplog: pytest.LogCaptureFixture) -> None:
    """A failed layer write makes the core release its registration's other writes; the driver then polled
    those released handles in the same pass and fed their ends to the core (one ERROR traceback each)."""
    spec = KVSpec(num_layers=4, kv_heads=2, head_dim=8, block_size=4)
    pair = Pair(spec, config=ConnectorConfig(layerwise=True), d_config=ConnectorConfig())
    try:
        blocks, n = [1, 2], 8
        pair.fill_p(blocks, n)
        pair.consumer.request_allocated("t1", [5, 6], n, 0, pair.remote())
        wait_for(lambda: pair.on_loop(lambda: pair.producer.core.registrations("t1")) == 1, "the push_reg")
        faults = pair.p_agent().faults
        faults.delay_s, faults.fail_transfers = 0.3, 3  # three layer writes in flight, all end FAILED
        with caplog.at_level(logging.INFO, logger="kvwire"):
            for layer in (0, 1, 2):
                pair.producer.layers_ready("t1", blocks, n, (layer,))
            wait_for(
                lambda: pair.on_loop(lambda: not pair.producer.core.streaming({"t1"})), "the writes' end"
            )
            pair.producer.request_finished("t1", blocks, n)
            assert pair.p_event("t1").outcome is ProducerOutcome.FAILED
            assert [(e.kind, e.reason) for e in pair.d_event("t1")][-1][1] is FailReason.WRITE_FAILED
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        pair.close()


def test_close_with_a_write_in_flight_releases_it_before_the_memory_goes() -> None:
    """``close`` told the engine SHUTDOWN (its blocks may go) and deregistered the memory while the
    write's handle was never released: the transfer went on reading what the engine reused."""
    pair = Pair(SPEC)
    try:
        agent = pair.p_agent()
        agent.faults.delay_s = 5.0
        pair.consumer.request_allocated("x", [0, 1], 8, 0, pair.remote())
        pair.producer.request_finished("x", [2, 3], 8)
        wait_for(lambda: pair.on_loop(lambda: bool(pair.producer._handles)), "the write posted")
        assert len(agent._pending) == 1
        pair.producer.close()
        assert [e.outcome for e in pair.producer.poll()] == [ProducerOutcome.SHUTDOWN]
        assert pair.producer._handles == {} and agent._pending == []
    finally:
        pair.close()


def test_a_start_that_cannot_bind_undoes_itself() -> None:
    """A side-channel port already taken: ``start`` left its loop thread and the memory it registered (one
    more of each per retry; ``close`` did nothing, and a later ``start`` registered the memory twice).
    The ``OSError`` passes: ``kvwire serve`` turns it into one line naming the port and the fix."""
    setup = build_engine("P", SPEC, num_blocks=8)
    agent = setup.ranks[0].agent
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        producer = Producer(setup.engine, setup.ranks, ConnectorConfig(), port=port, warm_up=False)
        for _ in range(2):
            with pytest.raises(OSError, match="in use"):
                producer.start()
            assert agent._regs == {}
            assert not [t for t in threading.enumerate() if t.name.startswith("kvwire-producer")]
    assert producer.start() == port and len(agent._regs) == 1
    producer.close()
    assert agent._regs == {}
    setup.close()
