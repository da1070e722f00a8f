"""Connector reliability on the in-process backend (deterministic): failures, timeouts, leases, dead and
restarted peers, reaping (issue 6 items 1, 3, 4; DESIGN.md §3).

Waits are bounded; where a test shows that something happens "at once", every timeout that could also
end the request is set far above the wait, so only the path under test can end it in time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from faults_env import Cluster, wait_for

from kvwire.connector import ConnectorConfig, ConsumerEvent, ConsumerEventKind, ProducerOutcome
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import FailReason
from kvwire.testing.engines import (
    gather_tokens,
    random_kv,
    same_bytes,
    scatter_tokens,
    untouched_blocks_zero,
)

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
K = ConsumerEventKind
LONG = 120.0  # a timeout that must not fire during a test
FAST = ConnectorConfig(heartbeat_interval_s=0.02, liveness_timeout_s=0.3, dead_peer_grace_s=0.05)


def _kinds(events: list[ConsumerEvent]) -> list[tuple[ConsumerEventKind, FailReason | None]]:
    return [(e.kind, e.reason) for e in events]


@pytest.fixture
def make_cluster() -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    class Tracked(Cluster):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    yield Tracked
    for cluster in made:
        cluster.close()


def _push(c: Cluster, tid: str, p_blocks: list[int], d_blocks: list[int], seed: int = 1) -> bool:
    """One request end to end; True when READY and D's blocks hold P's bytes."""
    kv = random_kv(SPEC, 4 * len(p_blocks), seed)
    scatter_tokens(c.p.ranks, p_blocks, kv)
    c.consumer.request_allocated(tid, d_blocks, kv.shape[3], 0, c.remote())
    c.producer.request_finished(tid, p_blocks, kv.shape[3])
    events = c.d_final(tid)
    return _kinds(events) == [(K.READY, None)] and same_bytes(
        gather_tokens(c.d.ranks, d_blocks, range(kv.shape[3])), kv
    )


# -- failed writes (C2) --------------------------------------------------------------------------------


def test_failed_write_reaches_d_at_once(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(transfer_timeout_s=LONG, liveness_timeout_s=LONG, kv_lease_duration_s=LONG)
    c = make_cluster(SPEC, cfg)
    c.p_agent().faults.fail_transfers = 1
    c.consumer.request_allocated("fw", [0, 1], 8, 0, c.remote())
    c.producer.request_finished("fw", [2, 3], 8)
    started = time.monotonic()
    events = c.d_final("fw", timeout_s=5.0)  # every timer is 120 s: only P's `failed` can end it now
    print(f"failed write reached D's RELEASED in {time.monotonic() - started:.3f} s")
    assert _kinds(events) == [(K.FAILED, FailReason.WRITE_FAILED), (K.RELEASED, FailReason.WRITE_FAILED)]
    assert c.p_event("fw").outcome is ProducerOutcome.FAILED
    assert c.producer.stats.failures[FailReason.WRITE_FAILED] == 1


def test_stuck_transfer_times_out_and_is_reported_failed(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(transfer_timeout_s=0.2, liveness_timeout_s=LONG, kv_lease_duration_s=LONG)
    c = make_cluster(SPEC, cfg)
    c.p_agent().faults.delay_s = LONG  # NIXL #2047: a write that never leaves IN_PROGRESS
    c.producer.request_finished("stuck", [2, 3], 8)
    c.consumer.request_allocated("stuck", [0, 1], 8, 0, c.remote())
    events = c.d_final("stuck", timeout_s=5.0)
    assert _kinds(events) == [
        (K.FAILED, FailReason.TRANSFER_TIMEOUT),
        (K.RELEASED, FailReason.TRANSFER_TIMEOUT),
    ]
    assert c.p_event("stuck").outcome is ProducerOutcome.FAILED
    assert c.p_agent()._pending == []  # released, so cancelled: it can never land later
    assert untouched_blocks_zero(c.d.ranks, [])


# -- leases (L1) ---------------------------------------------------------------------------------------


def test_lease_expiry_frees_p_blocks_when_d_never_registers(make_cluster: type[Cluster]) -> None:
    c = make_cluster(SPEC, ConnectorConfig(kv_lease_duration_s=0.1))
    c.producer.request_finished("orphan", [0, 1], 8)
    assert c.p_event("orphan", timeout_s=5.0).outcome is ProducerOutcome.EXPIRED


def test_d_heartbeats_extend_the_lease(make_cluster: type[Cluster]) -> None:
    # D's push_reg is lost, so P never hears of the registration, but D's heartbeats name the request:
    # P must keep its blocks past the 0.1 s lease while D still waits (until D gives up on P).
    cfg = ConnectorConfig(
        kv_lease_duration_s=0.1, heartbeat_interval_s=0.02, liveness_timeout_s=0.6, dead_peer_grace_s=0.05
    )
    c = make_cluster(SPEC, cfg)
    c.producer.request_finished("hb", [0, 1], 8)
    c.d_agent().faults.drop_notifs = 1  # D's first notification: the push_reg
    c.consumer.request_allocated("hb", [2, 3], 8, 0, c.remote())
    order: list[str] = []

    def step() -> bool:
        c.pump()
        if "d_failed" not in order and any(e.transfer_id == "hb" for e in c.d_events):
            order.append("d_failed")
        if "p_freed" not in order and any(e.transfer_id == "hb" for e in c.p_events):
            order.append("p_freed")
        return len(order) == 2

    wait_for(step, "both sides to end the request", 10.0)
    assert order == ["d_failed", "p_freed"]
    assert next(e for e in c.p_events if e.transfer_id == "hb").outcome is ProducerOutcome.EXPIRED


# -- dead peers (L1, S1) -------------------------------------------------------------------------------


def test_dead_producer_detected_within_liveness_and_every_request_ends(make_cluster: type[Cluster]) -> None:
    c = make_cluster(SPEC, FAST, num_blocks=64)
    tids = [f"dp{i}" for i in range(16)]
    for i, tid in enumerate(tids):
        c.consumer.request_allocated(tid, [2 * i, 2 * i + 1], 8, 0, c.remote())
    wait_for(lambda: c.consumer.stats.transfers_started >= len(tids), "every push_reg sent")
    dead_agent = c.p_agent().name
    killed = time.monotonic()
    c.kill_p()
    ended: dict[str, float] = {}

    def all_ended() -> bool:
        c.pump()
        for e in c.d_events:
            if e.kind is K.FAILED:
                ended.setdefault(e.transfer_id, time.monotonic() - killed)
        return all(any(e.transfer_id == t and e.kind is K.RELEASED for e in c.d_events) for t in tids)

    wait_for(all_ended, "every request on the dead P to end", 5.0)
    print(
        f"dead P: first FAILED {min(ended.values()):.3f} s, last {max(ended.values()):.3f} s after the kill"
    )
    assert {t: r for t, r in _reasons(c.d_events).items() if t in tids} == dict.fromkeys(
        tids, FailReason.PEER_DEAD
    )
    assert c.consumer.stats.peers_declared_dead == 1
    assert c.d_agent().peer_mode(dead_agent) is None  # nothing of it stays loaded
    assert untouched_blocks_zero(c.d.ranks, [])


def _reasons(events: list[ConsumerEvent]) -> dict[str, FailReason | None]:
    return {e.transfer_id: e.reason for e in events if e.kind is K.FAILED}


def test_dead_decode_lets_p_free_every_block(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(
        kv_lease_duration_s=0.3, fence_ms=300, heartbeat_interval_s=0.02, liveness_timeout_s=0.3
    )
    c = make_cluster(SPEC, cfg, num_blocks=64)
    registered = [f"reg{i}" for i in range(6)]
    for i, tid in enumerate(registered):
        c.consumer.request_allocated(tid, [2 * i, 2 * i + 1], 8, 0, c.remote())
    wait_for(lambda: c.consumer.stats.transfers_started >= len(registered), "every push_reg sent")
    # Let the push_regs arrive, then D dies before P finishes prefill: the writes cannot land.
    wait_for(lambda: c.producer.stats.handshakes_started >= 1, "P to hear of D")
    d_agent = c.d_agent().name
    c.kill_d()
    unregistered = [f"unreg{i}" for i in range(3)]
    for i, tid in enumerate(registered + unregistered):
        c.producer.request_finished(tid, [2 * i, 2 * i + 1], 8)
    outcomes = {tid: c.p_event(tid, timeout_s=5.0).outcome for tid in registered + unregistered}
    print("dead D, P outcomes:", sorted({o.value for o in outcomes.values()}))
    assert all(o in (ProducerOutcome.FAILED, ProducerOutcome.EXPIRED) for o in outcomes.values())
    assert c.p_agent().peer_mode(d_agent) is None  # nothing of the dead D stays loaded


def test_frozen_decode_with_a_write_in_flight_is_declared_dead_by_p(make_cluster: type[Cluster]) -> None:
    # Every timer but the liveness timeout is far away: only P's watch on D's heartbeats can end this.
    cfg = ConnectorConfig(
        kv_lease_duration_s=LONG,
        fence_ms=int(LONG * 1000),
        transfer_timeout_s=LONG,
        heartbeat_interval_s=0.02,
        liveness_timeout_s=0.3,
    )
    c = make_cluster(SPEC, cfg)
    c.p_agent().faults.delay_s = LONG  # the write stays in progress, as NIXL's does to a frozen peer
    scatter_tokens(c.p.ranks, [4, 5], random_kv(SPEC, 8, 3))
    c.consumer.request_allocated("fz", [0, 1], 8, 0, c.remote())
    c.producer.request_finished("fz", [4, 5], 8)
    wait_for(lambda: c.producer.stats.transfers_started == 1, "the write to be posted")
    d_agent = c.d_agent().name
    c.freeze_d()
    frozen_at = time.monotonic()
    event = c.p_event("fz", timeout_s=5.0)
    print(
        f"frozen D declared dead by P {time.monotonic() - frozen_at:.3f} s after the freeze (liveness 0.3 s)"
    )
    assert event.outcome is ProducerOutcome.FAILED
    assert c.producer.stats.peers_declared_dead == 1
    assert c.producer.stats.failures[FailReason.PEER_DEAD] == 1
    assert c.producer.stats.transfers_done == 0
    assert c.p_agent().peer_mode(d_agent) is None  # the dead D is unloaded
    # The write was released (which cancels it) before P's blocks were handed back: nothing is pending
    # on P's agent, and nothing of the request landed in D's blocks.
    assert not c.p_agent()._pending
    assert untouched_blocks_zero(c.d.ranks, [])


def test_frozen_decode_ends_registrations_before_any_write(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(
        kv_lease_duration_s=LONG, fence_ms=int(LONG * 1000), heartbeat_interval_s=0.02, liveness_timeout_s=0.3
    )
    c = make_cluster(SPEC, cfg)
    for i in range(4):
        c.consumer.request_allocated(f"pre{i}", [2 * i, 2 * i + 1], 8, 0, c.remote())
    wait_for(lambda: c.producer.stats.handshakes_started >= 4, "every push_reg to reach P")
    c.freeze_d()
    wait_for(lambda: c.producer.stats.peers_declared_dead == 1, "P to declare D dead", timeout_s=5.0)
    for i in range(4):  # prefill ends after D was declared dead: the blocks are freeable at once
        c.producer.request_finished(f"pre{i}", [2 * i, 2 * i + 1], 8)
    outcomes = {c.p_event(f"pre{i}", timeout_s=1.0).outcome for i in range(4)}
    assert outcomes == {ProducerOutcome.FAILED}
    assert c.producer.stats.failures[FailReason.PEER_DEAD] == 4
    assert c.producer.stats.transfers_started == 0
    assert untouched_blocks_zero(c.d.ranks, [])


def test_paused_producer_recalls_its_writes_before_progressing_them(make_cluster: type[Cluster]) -> None:
    # A frozen P resumes its posted writes at its first progress call; D may have declared it dead and
    # reused the blocks meanwhile. A write due 0.25 s after posting must not land after a 0.5 s pause.
    cfg = ConnectorConfig(
        kv_lease_duration_s=LONG,
        fence_ms=int(LONG * 1000),
        transfer_timeout_s=LONG,
        heartbeat_interval_s=0.02,
        liveness_timeout_s=0.3,
        dead_peer_grace_s=0.05,
    )
    c = make_cluster(SPEC, cfg)
    c.p_agent().faults.delay_s = 0.25
    scatter_tokens(c.p.ranks, [4, 5], random_kv(SPEC, 8, 3))
    c.consumer.request_allocated("pz", [0, 1], 8, 0, c.remote())
    c.producer.request_finished("pz", [4, 5], 8)
    wait_for(lambda: c.producer.stats.transfers_started == 1, "the write to be posted")
    c.loop.loop.call_soon_threadsafe(time.sleep, 0.5)  # the whole process stops (SIGSTOP)
    assert c.p_event("pz").outcome is ProducerOutcome.FAILED
    assert c.producer.stats.failures[FailReason.TRANSFER_TIMEOUT] == 1
    assert c.producer.stats.transfers_done == 0
    assert [e.kind for e in c.d_final("pz")] == [K.FAILED, K.RELEASED]
    assert untouched_blocks_zero(c.d.ranks, [])


def test_p_declared_dead_then_heard_again_serves_the_next_request(make_cluster: type[Cluster]) -> None:
    # A healed partition: P never restarted (same incarnation), D declared it dead meanwhile. The next
    # request handshakes afresh and must not inherit the old verdict.
    # The old request is still in its grace period when the next one starts.
    c = make_cluster(
        SPEC, ConnectorConfig(heartbeat_interval_s=0.5, liveness_timeout_s=0.6, dead_peer_grace_s=2.0)
    )
    c.p_agent().faults.drop_rate = 1.0  # everything P says vanishes: from D, a partition
    c.consumer.request_allocated("cut", [0, 1], 8, 0, c.remote())

    def cut_failed() -> bool:
        c.pump()
        return any(e.transfer_id == "cut" and e.kind is K.FAILED for e in c.d_events)

    wait_for(cut_failed, "D to declare P dead", 5.0)
    assert _reasons(c.d_events)["cut"] is FailReason.PEER_DEAD
    c.p_agent().faults.drop_rate = 0.0  # healed
    assert _push(c, "healed", [2, 3], [2, 3], seed=4)
    assert c.consumer.stats.peers_declared_dead == 1
    assert [e.kind for e in c.d_final("cut", timeout_s=5.0)] == [K.FAILED, K.RELEASED]


# -- restarts (NIXL #795) and reaping ------------------------------------------------------------------


def test_restarted_producer_is_used_without_restarting_d(make_cluster: type[Cluster]) -> None:
    c = make_cluster(SPEC, FAST)
    assert _push(c, "before", [0, 1], [0, 1])
    old_agent, old_incarnation = c.p_agent().name, c.p.engine.incarnation
    c.kill_p()
    c.start_p()  # same engine id and address, new incarnation
    assert c.p.engine.incarnation != old_incarnation
    assert _push(c, "after", [2, 3], [2, 3], seed=2)  # the first request after the restart already works
    assert c.d_agent().peer_mode(old_agent) is None
    assert c.d_agent().peer_mode(c.p_agent().name) is not None


def test_restart_during_a_request_fails_it_then_the_new_life_serves(make_cluster: type[Cluster]) -> None:
    c = make_cluster(SPEC, FAST)
    c.consumer.request_allocated("inflight", [0, 1], 8, 0, c.remote())
    wait_for(lambda: c.consumer.stats.transfers_started, "push_reg sent")
    c.kill_p()
    c.start_p()
    events = c.d_final("inflight", timeout_s=5.0)
    assert _kinds(events)[0] == (K.FAILED, FailReason.PEER_DEAD)
    assert _push(c, "next", [2, 3], [2, 3], seed=3)


def test_idle_peers_are_reaped_and_come_back_on_use(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(engine_ttl_s=0.15, heartbeat_interval_s=0.02, liveness_timeout_s=0.3)
    c = make_cluster(SPEC, cfg)
    assert _push(c, "first", [0, 1], [0, 1])
    p_name, d_name = c.p_agent().name, c.d_agent().name
    wait_for(
        lambda: c.d_agent().peer_mode(p_name) is None and c.p_agent().peer_mode(d_name) is None,
        "both sides to unload the idle peer",
        5.0,
    )
    assert c.consumer.stats.peers_reaped >= 1 and c.producer.stats.peers_reaped >= 1
    assert _push(c, "again", [2, 3], [2, 3], seed=4)


def test_peers_in_use_are_not_reaped(make_cluster: type[Cluster]) -> None:
    cfg = ConnectorConfig(engine_ttl_s=0.1, heartbeat_interval_s=0.02, liveness_timeout_s=0.3)
    c = make_cluster(SPEC, cfg)
    kv = random_kv(SPEC, 8, 5)
    scatter_tokens(c.p.ranks, [0, 1], kv)
    c.consumer.request_allocated("long", [0, 1], 8, 0, c.remote())
    wait_for(lambda: c.consumer.stats.transfers_started, "push_reg sent")
    p_name = c.p_agent().name
    deadline = time.monotonic() + 0.5  # five TTLs of a long prefill: the peer is in use all along
    while time.monotonic() < deadline:
        assert c.d_agent().peer_mode(p_name) is not None
        time.sleep(0.01)
    c.producer.request_finished("long", [0, 1], 8)
    assert _kinds(c.d_final("long")) == [(K.READY, None)]
    assert same_bytes(gather_tokens(c.d.ranks, [0, 1], range(8)), kv)
