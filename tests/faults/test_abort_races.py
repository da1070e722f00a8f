"""Abort fencing (DESIGN.md §3 item 2): randomized abort/write races on the in-process backend.

Many requests run at once. Each is aborted at a random moment (by D, by P, or both) or not at all, while
P's writes are held in flight for a random number of progress calls. The instant a side is told it may
free blocks, the test reuses them, as an engine would:

* D's blocks (after READY or RELEASED) are filled with a guard byte and held a random while; any write
  landing in them afterwards changes the guard;
* P's blocks (after its event) are overwritten at once; a write still reading them would bring the
  overwritten bytes to D, so every READY request's KV is compared with what P had prefilled.

Both counts of corrupted bytes must be zero, and every request must end on both sides.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvwire.connector import ConnectorConfig, ConsumerEventKind, ProducerOutcome
from kvwire.kv.spec import KVSpec
from kvwire.testing.engines import gather_tokens, random_kv, scatter_tokens
from kvwire.testing.faults_env import Cluster, block_bytes

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=4, block_size=4)
RACES = 10_000  # requests aborted at a random moment
IN_FLIGHT = 96
NUM_BLOCKS = 1024
TIME_LIMIT_S = 90.0  # the driving loop is bounded whatever happens
STALL_S = 10.0  # no request ended for this long: stop and report (the assertions then fail)
TICK_S = 0.0005


@dataclass
class _Req:
    tid: str
    d_blocks: list[int]
    p_blocks: list[int]
    num_tokens: int
    kv: np.ndarray
    abort_d_at: int | None  # driver iteration at which D aborts, if it does
    abort_p_at: int | None
    p_done: bool = False
    d_done: bool = False
    outcome: str = ""


@dataclass
class _Guard:
    blocks: list[int]
    byte: int
    until: int


@dataclass
class _Stats:
    started: int = 0
    races: int = 0
    ready: int = 0
    released: int = 0
    corrupted_guard_bytes: int = 0
    corrupted_ready_bytes: int = 0
    guards_checked: int = 0
    p_outcomes: dict[str, int] = field(default_factory=dict)


class _Driver:
    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.c = cluster
        self.rng = random.Random(seed)
        self.d_free: deque[int] = deque(range(NUM_BLOCKS))
        self.p_free: deque[int] = deque(range(NUM_BLOCKS))
        self.live: dict[str, _Req] = {}
        self.guards: list[_Guard] = []
        self.stats = _Stats()
        self.d_bytes = block_bytes(cluster.d.ranks[0].cache)
        self.p_bytes = block_bytes(cluster.p.ranks[0].cache)
        self.it = 0
        self.kv_pool = [random_kv(SPEC, 3 * SPEC.block_size, seed=s) for s in range(16)]

    def start_one(self) -> bool:
        n_blocks = self.rng.randint(1, 3)
        if len(self.d_free) < n_blocks or len(self.p_free) < n_blocks:
            return False
        num_tokens = (n_blocks - 1) * SPEC.block_size + self.rng.randint(1, SPEC.block_size)
        d_blocks = [self.d_free.popleft() for _ in range(n_blocks)]
        p_blocks = [self.p_free.popleft() for _ in range(n_blocks)]
        kv = self.kv_pool[self.stats.started % len(self.kv_pool)][:, :, :, :num_tokens]
        scatter_tokens(self.c.p.ranks, p_blocks, kv)
        roll = self.rng.random()
        soon = self.it + self.rng.randint(0, 12)
        abort_d = soon if roll < 0.55 else None
        # P hears of most of D's aborts from the router too; when it does not, and D aborted before its
        # push_reg left, only P's lease frees P's blocks.
        both = roll < 0.45 and self.rng.random() < 0.8
        abort_p = self.it + self.rng.randint(0, 12) if both or 0.45 < roll < 0.8 else None
        req = _Req(f"r{self.stats.started}", d_blocks, p_blocks, num_tokens, kv, abort_d, abort_p)
        self.stats.started += 1
        if abort_d is not None or abort_p is not None:
            self.stats.races += 1
        self.live[req.tid] = req
        # A random number of progress calls before each write lands: aborts meet writes in flight.
        self.c.p_agent().faults.delay_calls = self.rng.randint(0, 6)
        remote = self.c.remote()
        if self.rng.random() < 0.5:
            self.c.consumer.request_allocated(req.tid, d_blocks, num_tokens, 0, remote)
            self.c.producer.request_finished(req.tid, p_blocks, num_tokens)
        else:
            self.c.producer.request_finished(req.tid, p_blocks, num_tokens)
            self.c.consumer.request_allocated(req.tid, d_blocks, num_tokens, 0, remote)
        return True

    def fire_aborts(self) -> None:
        for req in list(self.live.values()):
            if req.abort_d_at == self.it and not req.d_done:
                self.c.consumer.abort(req.tid)
            if req.abort_p_at == self.it and not req.p_done:
                self.c.producer.abort(req.tid)

    def on_events(self) -> None:
        for pe in self.c.producer.poll():
            req = self.live[pe.transfer_id]
            assert not req.p_done, f"two producer events for {req.tid}"
            req.p_done = True
            self.stats.p_outcomes[pe.outcome.value] = self.stats.p_outcomes.get(pe.outcome.value, 0) + 1
            # P reuses its blocks at once: a write still reading them would carry these bytes to D.
            self.p_bytes[:, :, req.p_blocks] = self.rng.randint(1, 255)
            self.p_free.extend(req.p_blocks)
            self._maybe_forget(req)
        for de in self.c.consumer.poll():
            req = self.live[de.transfer_id]
            if de.kind is ConsumerEventKind.FAILED:
                continue
            assert not req.d_done, f"two final consumer events for {req.tid}"
            req.d_done = True
            if de.kind is ConsumerEventKind.READY:
                self.stats.ready += 1
                got = gather_tokens(self.c.d.ranks, req.d_blocks, range(req.num_tokens))
                bad = np.count_nonzero(got.view(np.uint8) != np.ascontiguousarray(req.kv).view(np.uint8))
                self.stats.corrupted_ready_bytes += int(bad)
            else:
                self.stats.released += 1
            # D reuses its blocks at once, for another request's known bytes, held a random while.
            byte = self.rng.randint(1, 255)
            self.d_bytes[:, :, req.d_blocks] = byte
            self.guards.append(_Guard(req.d_blocks, byte, self.it + self.rng.randint(1, 40)))
            self._maybe_forget(req)

    def _maybe_forget(self, req: _Req) -> None:
        if req.p_done and req.d_done:
            del self.live[req.tid]

    def check_guards(self, force: bool = False) -> None:
        keep = []
        for g in self.guards:
            if not force and g.until > self.it:
                keep.append(g)
                continue
            region = self.d_bytes[:, :, g.blocks]
            self.stats.corrupted_guard_bytes += int(np.count_nonzero(region != g.byte))
            self.stats.guards_checked += 1
            self.d_bytes[:, :, g.blocks] = 0
            self.d_free.extend(g.blocks)
        self.guards = keep

    def run(self) -> _Stats:
        deadline = time.monotonic() + TIME_LIMIT_S
        ended, last_change = 0, time.monotonic()
        while time.monotonic() < deadline:
            if self.stats.ready + self.stats.released != ended:
                ended, last_change = self.stats.ready + self.stats.released, time.monotonic()
            elif self.live and time.monotonic() - last_change > STALL_S:
                break
            self.it += 1
            time.sleep(TICK_S)
            while self.stats.races < RACES and len(self.live) < IN_FLIGHT and self.start_one():
                pass
            self.fire_aborts()
            self.on_events()
            self.check_guards()
            if self.stats.races >= RACES and not self.live:
                break
        self.check_guards(force=True)
        return self.stats


def test_abort_write_races_corrupt_nothing() -> None:
    # Only writes, aborts, their fencing and P's lease (for aborts P never hears of) end requests here.
    config = ConnectorConfig(kv_lease_duration_s=0.3, liveness_timeout_s=120.0, transfer_timeout_s=120.0)
    cluster = Cluster(SPEC, config, num_blocks=NUM_BLOCKS)
    try:
        driver = _Driver(cluster, seed=6)
        stats = driver.run()
        print(stats)
        stuck = sorted(driver.live)
        assert not stuck, f"{len(stuck)} requests never ended, e.g. {stuck[:5]}; {stats}"
        assert stats.races >= RACES
        assert stats.guards_checked == stats.ready + stats.released == stats.started
        assert stats.corrupted_guard_bytes == 0
        assert stats.corrupted_ready_bytes == 0
        assert sum(stats.p_outcomes.values()) == stats.started
        assert stats.p_outcomes.get(ProducerOutcome.SENT.value, 0) > 0
        assert stats.p_outcomes.get(ProducerOutcome.ABORTED.value, 0) > 0
        assert stats.released > 0 and stats.ready > 0
        assert cluster.consumer.stats.cancels > 0
    finally:
        cluster.close()
