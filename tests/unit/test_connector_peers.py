"""Peer lifecycle on the in-process backend (issue 6 item 4, NIXL #795): idle peers reaped, peers in use
kept, restarted peers handshaked again and used, nothing of a dead or replaced peer left loaded."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.connector import ConnectorConfig, ConsumerEventKind, ProducerOutcome
from kvwire.connector.timeline import Stage
from kvwire.kv.spec import KVSpec
from kvwire.testing.clock import VirtualClock
from kvwire.testing.connector_env import Pair, wait_for
from kvwire.testing.engines import same_bytes, untouched_blocks_zero

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
READY = [ConsumerEventKind.READY]


def _push(pair: Pair, tid: str, p_blocks: list[int], d_blocks: list[int], n: int, seed: int) -> np.ndarray:
    kv = pair.fill_p(p_blocks, n, seed=seed)
    pair.consumer.request_allocated(tid, d_blocks, n, 0, pair.remote())
    pair.producer.request_finished(tid, p_blocks, n)
    assert [e.kind for e in pair.d_event(tid)] == READY
    assert pair.p_event(tid).outcome is ProducerOutcome.SENT
    assert same_bytes(pair.d_tokens(d_blocks, range(n)), kv)
    return kv


def _loaded(pair: Pair) -> tuple[list[str], list[str]]:
    """Agent names each side's handshake managers keep loaded (P's view of D, D's view of P)."""
    p_peers = [peer.agent_name for m in pair.producer.managers.values() for peer in m.peers()]
    d_peers = [peer.agent_name for m in pair.consumer.managers.values() for peer in m.peers()]
    return p_peers, d_peers


def _ticked(pair: Pair, now: float) -> bool:
    """Both cores have taken a tick at ``now`` (their next wake-up is after it)."""
    return pair.on_loop(lambda: min(pair.producer.core.wake_at(), pair.consumer.core.wake_at()) > now)


def test_idle_peers_are_reaped_and_reconnected_on_demand() -> None:
    # Virtual time: a TTL of a minute passes when the test moves the connectors' one clock.
    clock = VirtualClock()
    cfg = ConnectorConfig(engine_ttl_s=60.0, heartbeat_interval_s=10.0, liveness_timeout_s=600.0)
    pair = Pair(SPEC, config=cfg, clock=clock)
    try:
        _push(pair, "r1", [0, 1], [2, 3], 8, seed=1)
        p_agent, d_agent = pair.p.ranks[0].agent, pair.d.ranks[0].agent
        clock.advance(30.0)
        wait_for(lambda: _ticked(pair, clock.now), "a tick at 30 s")
        assert len(_loaded(pair)[0]) == 1 and len(_loaded(pair)[1]) == 1  # half the TTL: kept
        clock.advance(31.0)
        wait_for(lambda: _loaded(pair) == ([], []), "both sides reap the idle peer")
        assert pair.producer.stats.peers_reaped >= 1 and pair.consumer.stats.peers_reaped >= 1
        assert pair.on_loop(lambda: (p_agent.peer_mode(d_agent.name), d_agent.peer_mode(p_agent.name))) == (
            None,
            None,
        )
        _push(pair, "r2", [4, 5], [6, 7], 8, seed=2)  # handshaked again on demand
        clock.advance(11.0)  # the map is pruned at every heartbeat period
        wait_for(lambda: pair.consumer.watched_peers() == [], "liveness map pruned")
    finally:
        pair.close()


def test_peers_in_use_are_not_reaped() -> None:
    # Virtual time: the request stays live for eight heartbeat periods, past the TTL (60 s); only the
    # connector's own "in use" refresh keeps the peers loaded.
    clock = VirtualClock()
    cfg = ConnectorConfig(
        engine_ttl_s=60.0, heartbeat_interval_s=11.0, liveness_timeout_s=600.0, fence_ms=600_000
    )
    pair = Pair(SPEC, config=cfg, clock=clock)
    try:
        pair.consumer.request_allocated("long", [0, 1], 8, 0, pair.remote())
        wait_for(lambda: all(_loaded(pair)), "both sides loaded (P holds the early registration)")
        for _ in range(12):  # a heartbeat period (and a reaper pass) per step, 12 s of virtual time
            if pair.producer.stats.heartbeats_sent >= 8:
                break
            clock.advance(12.0)
            wait_for(lambda: _ticked(pair, clock.now), "both sides ticked at the new time")
        assert pair.producer.stats.heartbeats_sent >= 8  # well past the TTL, the request still live
        assert pair.producer.stats.peers_reaped == 0 and pair.consumer.stats.peers_reaped == 0
        p_peers, d_peers = _loaded(pair)
        assert p_peers == [pair.d.ranks[0].agent.name] and d_peers == [pair.p.ranks[0].agent.name]
        kv = pair.fill_p([4, 5], 8)
        pair.producer.request_finished("long", [4, 5], 8)
        assert [e.kind for e in pair.d_event("long")] == READY
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
        clock.advance(61.0)
        wait_for(lambda: _loaded(pair) == ([], []), "reaped once idle")
    finally:
        pair.close()


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "closed"])
def test_restarted_producer_is_handshaked_again_without_restarting_d(kill: bool) -> None:
    pair = Pair(SPEC, config=ConnectorConfig(heartbeat_interval_s=0.02, liveness_timeout_s=1.0))
    try:
        _push(pair, "before", [0, 1], [0, 1], 8, seed=1)
        old = pair.p.ranks[0].agent.name
        old_life = (pair.p.engine.engine_id, pair.p.engine.incarnation)
        pair.restart_p(kill=kill)
        new = pair.p.ranks[0].agent.name
        assert new != old
        kv = _push(pair, "after", [2, 3], [4, 5], 8, seed=2)
        assert same_bytes(pair.d_tokens([4, 5], range(8)), kv)
        d_agent = pair.d.ranks[0].agent
        assert pair.on_loop(lambda: (d_agent.peer_mode(old), d_agent.peer_mode(new) is not None)) == (
            None,
            True,
        )
        assert _loaded(pair)[1] == [new]
        wait_for(lambda: old_life not in pair.consumer.watched_peers(), "the old life's liveness pruned")
        assert untouched_blocks_zero(pair.d.ranks, [0, 1, 4, 5])
    finally:
        pair.close()


def test_restarted_consumer_replaces_the_old_one_on_p() -> None:
    pair = Pair(SPEC)
    try:
        _push(pair, "before", [0, 1], [0, 1], 8, seed=1)
        old = pair.d.ranks[0].agent.name
        pair.restart_d()
        new = pair.d.ranks[0].agent.name
        kv = _push(pair, "after", [2, 3], [6, 7], 8, seed=2)
        assert same_bytes(pair.d_tokens([6, 7], range(8)), kv)
        p_agent = pair.p.ranks[0].agent
        assert pair.on_loop(lambda: p_agent.peer_mode(old)) is None
        assert _loaded(pair)[0] == [new]
        assert untouched_blocks_zero(pair.d.ranks, [6, 7])  # the new D's cache starts zeroed
    finally:
        pair.close()


def test_a_cached_peer_is_used_in_the_same_loop_pass_as_the_engine_call() -> None:
    """Once D has loaded P, a request's push_reg leaves inside the loop callback that took the engine's
    ``request_allocated``: the cached handshake's answer follows that input as an outcome does. It used to
    come one loop pass later, a pass (and on a quiet loop a wake-up) per rank pair and request."""
    pair = Pair(SPEC)
    try:
        _push(pair, "warm", [0, 1], [2, 3], 8, seed=1)  # D loads P: later requests find it cached
        conn = pair.consumer
        sent_in_handoff: list[bool] = []
        handoff = conn._handoff

        def recording(inp: object) -> None:
            handoff(inp)  # type: ignore[arg-type]
            sent_in_handoff.append(Stage.PUSH_REG_SENT in conn.timeline.get("cached"))

        conn._handoff = recording  # type: ignore[method-assign]
        _push(pair, "cached", [4, 5], [6, 7], 8, seed=2)
        assert sent_in_handoff[0] is True, "the push_reg waited for a later loop pass"
        hits = sum(m.stats.cache_hits for m in conn.managers.values())
        assert hits >= 1  # served from the cache, not a new handshake
    finally:
        pair.close()
