"""Connector reliability on the in-process backend: a failed write reaches D at once, a restarted P is
used without restarting D, idle peers are reaped and come back (issue 6 items 1, 3, 4; DESIGN.md §3).

The timed rules (transfer timeout, leases and heartbeats, liveness on both sides, grace and quarantine,
P's recall after a freeze) are pinned in virtual time by ``tests/unit/test_cores_producer.py`` and
``test_cores_consumer.py`` and exercised under faults by the simulator (``tests/unit/test_sim.py``);
the real-time versions that lived here are gone.

Waits are bounded; where a test shows that something happens "at once", every timeout that could also
end the request is set far above the wait, so only the path under test can end it in time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvwire.connector import ConnectorConfig, ConsumerEvent, ConsumerEventKind, ProducerOutcome
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import FailReason
from kvwire.testing.engines import (
    gather_tokens,
    random_kv,
    same_bytes,
    scatter_tokens,
)
from kvwire.testing.faults_env import Cluster, wait_for

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


# -- leases (L1) ---------------------------------------------------------------------------------------


# -- dead peers (L1, S1) -------------------------------------------------------------------------------


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
