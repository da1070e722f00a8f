"""Producer and Consumer end to end on the in-process backend: bytes moved, mapping, order of events."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.connector import ConnectorConfig, ConsumerEventKind, ProducerOutcome
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.messages import TransferMode
from kvwire.testing.clock import VirtualClock
from kvwire.testing.connector_env import Pair
from kvwire.testing.engines import same_bytes, scatter_tokens, untouched_blocks_zero, wait_for

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4)


def _push(
    pair: Pair, tid: str, p_blocks: list[int], d_blocks: list[int], n: int, *, reg_first: bool
) -> np.ndarray:
    kv = pair.fill_p(p_blocks, n)
    if reg_first:
        pair.consumer.request_allocated(tid, d_blocks, n, 0, pair.remote())
        pair.producer.request_finished(tid, p_blocks, n)
    else:
        pair.producer.request_finished(tid, p_blocks, n)
        pair.consumer.request_allocated(tid, d_blocks, n, 0, pair.remote())
    events = pair.d_event(tid)
    assert [e.kind for e in events] == [ConsumerEventKind.READY]
    assert pair.p_event(tid).outcome is ProducerOutcome.SENT
    return kv


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "layout"),
    [
        (1, 1, 1, Layout.HND),
        (2, 1, 1, Layout.HND),
        (1, 1, 2, Layout.HND),
        (1, 2, 1, Layout.HND),
        (2, 2, 4, Layout.NHD),
    ],
)
def test_push_moves_the_exact_bytes(p_tp: int, p_pp: int, d_tp: int, layout: Layout) -> None:
    spec = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4, layout=layout)
    pair = Pair(spec, p_tp=p_tp, p_pp=p_pp, d_tp=d_tp)
    try:
        p_blocks, d_blocks, n = [3, 4, 9, 10], [7, 2, 3, 20], 14
        kv = _push(pair, "r1", p_blocks, d_blocks, n, reg_first=True)
        assert same_bytes(pair.d_tokens(d_blocks, range(n)), kv[:, :, :, :n])
        assert untouched_blocks_zero(pair.d.ranks, d_blocks)
        expected_writes = len(pair.p.ranks) * max(1, d_tp // p_tp)
        assert pair.producer.stats.transfers_done == expected_writes
        assert pair.consumer.stats.transfers_done == 1
    finally:
        pair.close()


def test_registration_after_finish_and_many_requests() -> None:
    pair = Pair(SPEC, p_tp=2, d_tp=1)
    try:
        kv = _push(pair, "late-reg", [0, 1], [5, 6], 8, reg_first=False)
        assert same_bytes(pair.d_tokens([5, 6], range(8)), kv)
        kv2 = _push(pair, "early-reg", [2, 3], [8, 9], 7, reg_first=True)
        assert same_bytes(pair.d_tokens([8, 9], range(7)), kv2)
        # A half-block head slice is not contiguous across blocks: one descriptor per block and region.
        assert pair.producer.stats.descriptors_posted == 2 * 2 * (SPEC.num_layers * 2) * 2
    finally:
        pair.close()


def test_prefix_hit_writes_only_the_uncached_suffix() -> None:
    pair = Pair(SPEC)
    try:
        p_blocks, d_blocks, n, cached = [0, 1, 2], [10, 11, 12], 12, 4
        kv = pair.fill_p(p_blocks, n)
        prefix = np.full_like(kv[:, :, :, :cached], 7)
        scatter_tokens(
            pair.d.ranks, d_blocks, np.concatenate([prefix, np.zeros_like(kv[:, :, :, cached:])], axis=3)
        )
        pair.consumer.request_allocated("hit", d_blocks, n, cached, pair.remote())
        pair.producer.request_finished("hit", p_blocks, n)
        assert [e.kind for e in pair.d_event("hit")] == [ConsumerEventKind.READY]
        got = pair.d_tokens(d_blocks, range(n))
        assert same_bytes(got[:, :, :, :cached], prefix)  # D's own prefix is untouched
        assert same_bytes(got[:, :, :, cached:], kv[:, :, :, cached:])
        # Blocks contiguous on both sides coalesce: one descriptor per (layer, kind) region. P counts the
        # bytes when it sees the write end, which may be after D's READY: wait for P's event.
        assert pair.p_event("hit").outcome is ProducerOutcome.SENT
        assert pair.producer.stats.descriptors_posted == SPEC.num_layers * 2
        assert pair.producer.stats.bytes_moved == 2 * SPEC.num_layers * 2 * SPEC.block_bytes(SPEC.kv_heads)
    finally:
        pair.close()


def test_full_prefix_hit_is_ready_without_a_write() -> None:
    pair = Pair(SPEC)
    try:
        pair.consumer.request_allocated("all", [1, 2], 8, 8, pair.remote())
        pair.producer.request_finished("all", [3, 4], 8)
        assert [e.kind for e in pair.d_event("all")] == [ConsumerEventKind.READY]
        assert pair.p_event("all").outcome is ProducerOutcome.SENT
        assert pair.producer.stats.transfers_started == 0
        assert untouched_blocks_zero(pair.d.ranks, [])
    finally:
        pair.close()


def test_pull_reads_then_tells_p() -> None:
    pair = Pair(SPEC, p_tp=2, d_tp=1, mode=TransferMode.PULL)
    try:
        p_blocks, d_blocks, n = [4, 5, 6], [0, 9, 1], 10
        kv = pair.fill_p(p_blocks, n)
        pair.producer.request_finished("pull", p_blocks, n)
        pair.consumer.request_allocated("pull", d_blocks, n, 0, pair.remote(tuple(p_blocks)))
        assert [e.kind for e in pair.d_event("pull")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens(d_blocks, range(n)), kv)
        assert pair.p_event("pull").outcome is ProducerOutcome.PULLED
        # Pull needs D to load P in full; push never does (tests in test_connector_faults).
        assert pair.consumer.stats.transfers_started == 2
    finally:
        pair.close()


def test_d_loads_p_notif_only_and_p_loads_d_in_full() -> None:
    pair = Pair(SPEC)
    try:
        _push(pair, "asym", [0], [0], 4, reg_first=True)
        d_agent, p_agent = pair.d.ranks[0].agent, pair.p.ranks[0].agent
        assert d_agent.peer_mode(p_agent.name) is not None
        assert d_agent.peer_mode(p_agent.name).value == "notif_only"  # type: ignore[union-attr]
        assert p_agent.peer_mode(d_agent.name).value == "full"  # type: ignore[union-attr]
    finally:
        pair.close()


def test_lease_expires_without_registration() -> None:
    # Virtual time: the lease is a minute, and it passes when the test moves the connectors' clock.
    clock = VirtualClock()
    # Liveness far above the jumps: a gap between a core's inputs that long would read as a freeze.
    cfg = ConnectorConfig(kv_lease_duration_s=60.0, heartbeat_interval_s=10.0, liveness_timeout_s=600.0)
    pair = Pair(SPEC, config=cfg, clock=clock)
    try:
        pair.producer.request_finished("nobody", [0, 1], 8)
        wait_for(lambda: pair.on_loop(lambda: pair.producer.core.live), "P holds the request")
        clock.advance(59.0)
        wait_for(lambda: pair.on_loop(lambda: pair.producer.core.wake_at() >= clock.now), "a tick at 59 s")
        assert pair.producer.poll() == []  # not yet: the lease has a second left
        clock.advance(2.0)
        assert pair.p_event("nobody").outcome is ProducerOutcome.EXPIRED
    finally:
        pair.close()


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL], ids=["push", "pull"])
def test_a_declined_request_frees_ps_blocks_through_the_connectors(mode: TransferMode) -> None:
    """D's engine dropped the request before allocating it (``decline``): each P rank (TP 2 here) is told
    over a real handshake, and P's blocks come back at once (the lease is a minute: virtual time, never
    moved). D sees no event: nothing of its blocks was involved."""
    cfg = ConnectorConfig(mode=mode, kv_lease_duration_s=60.0)
    pair = Pair(SPEC, p_tp=2, mode=mode, config=cfg, clock=VirtualClock())
    try:
        pair.producer.request_finished("gone", [0, 1], 8)
        pair.consumer.decline("gone", pair.remote((0, 1)))
        assert pair.p_event("gone").outcome is ProducerOutcome.ABORTED
        assert pair.producer.stats.failures == {}  # D gave it up: not a failed transfer
        assert pair.consumer.poll() == [] and pair.consumer.stats.dropped_notifs == {}
    finally:
        pair.close()
