"""Connector failure paths on the in-process backend: failed writes, cancel fencing, fences, dead peers."""

from __future__ import annotations

from connector_env import Pair, wait_for

from kvwire.connector import ConnectorConfig, ConsumerEventKind, ProducerOutcome
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import FailReason, PushReg
from kvwire.testing.engines import same_bytes, untouched_blocks_zero

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


def test_cancel_during_write_waits_for_the_write() -> None:
    pair = Pair(SPEC)
    try:
        pair.p_agent().faults.delay_s = 0.2  # the write stays in flight while the cancel arrives
        kv = pair.fill_p([2, 3], 8)
        pair.producer.request_finished("c2", [2, 3], 8)
        pair.consumer.request_allocated("c2", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: pair.producer.stats.transfers_started, "write posted")
        pair.consumer.abort("c2")
        assert _kinds(pair.d_event("c2")) == [(K.RELEASED, None)]
        # Released only once the write had landed: the blocks hold P's bytes and no write is in flight.
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
        assert pair.producer.stats.transfers_done == 1
        assert pair.p_event("c2").outcome is ProducerOutcome.ABORTED
    finally:
        pair.close()


def test_fence_expiry_ends_the_registration() -> None:
    pair = Pair(SPEC, config=ConnectorConfig(fence_ms=30))
    try:
        pair.consumer.request_allocated("f", [0, 1], 8, 0, pair.remote())
        events = pair.d_event("f")
        assert _kinds(events) == [
            (K.FAILED, FailReason.FENCE_EXPIRED),
            (K.RELEASED, FailReason.FENCE_EXPIRED),
        ]
        pair.producer.request_finished("f", [2, 3], 8)  # too late: no write may start now
        assert pair.p_event("f").outcome is ProducerOutcome.FAILED
        assert pair.producer.stats.transfers_started == 0
    finally:
        pair.close()


def test_stuck_transfer_times_out() -> None:
    pair = Pair(SPEC, config=ConnectorConfig(transfer_timeout_s=0.05))
    try:
        pair.p_agent().faults.delay_s = 30.0
        pair.producer.request_finished("slow", [2, 3], 8)
        pair.consumer.request_allocated("slow", [0, 1], 8, 0, pair.remote())
        events = pair.d_event("slow")
        assert _kinds(events)[0] == (K.FAILED, FailReason.TRANSFER_TIMEOUT)
        assert pair.p_event("slow").outcome is ProducerOutcome.FAILED
        assert untouched_blocks_zero(pair.d.ranks, [])  # the released write never copied
    finally:
        pair.close()


def test_dead_producer_is_detected_and_blocks_released_after_grace() -> None:
    cfg = ConnectorConfig(heartbeat_interval_s=0.02, liveness_timeout_s=0.15, dead_peer_grace_s=0.05)
    pair = Pair(SPEC, config=cfg)
    try:
        pair.consumer.request_allocated("dead", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: pair.consumer.stats.transfers_started, "push_reg sent")
        pair.fabric.kill(pair.p_agent().name)
        events = pair.d_event("dead")
        assert _kinds(events) == [(K.FAILED, FailReason.PEER_DEAD), (K.RELEASED, FailReason.PEER_DEAD)]
        assert pair.consumer.stats.peers_declared_dead == 1
        assert pair.d.ranks[0].agent.peer_mode(pair.p_agent().name) is None  # nothing of it stays loaded
    finally:
        pair.close()


def test_live_producer_heartbeats_keep_a_long_prefill_alive() -> None:
    cfg = ConnectorConfig(heartbeat_interval_s=0.01, liveness_timeout_s=0.05)
    pair = Pair(SPEC, config=cfg)
    try:
        pair.consumer.request_allocated("long", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: pair.producer.stats.heartbeats_sent >= 20, "P heartbeats past 4 liveness timeouts")
        kv = pair.fill_p([2, 3], 8)
        pair.producer.request_finished("long", [2, 3], 8)
        assert _kinds(pair.d_event("long")) == [(K.READY, None)]
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
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
