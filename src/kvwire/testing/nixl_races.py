"""Randomized abort/write races over real NIXL: the P and D halves, each run inside its connector worker.

Both workers derive the same request schedule from one seed (request ``r{i}``: its block count, token
count, KV pattern, and whether and when P and/or D abort it), then each drives its own connector with at
most ``window`` requests in flight, its own free-block pool, and aborts fired at random moments (writes
are then in flight, just posted, not yet posted, or done). The instant a side may reuse blocks, it does:

* P (at its ``ProducerEvent``) overwrites its blocks with a random byte at once: a write still reading
  them would carry that byte to D, so D compares every READY request's KV with the pattern P prefilled;
* D (at READY, after that comparison, or at RELEASED) fills its blocks with a guard byte, holds them a
  random while, then checks the guard: a write landing after D was told it may reuse them changes it.

Each half returns its counts; the test requires zero corrupted bytes and every request ended on both sides.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.connector import Consumer, ConsumerEventKind, Producer, RemoteEngine
from kvwire.kv.spec import KVSpec
from kvwire.testing.engines import EngineSetup, gather_tokens, random_kv, scatter_tokens

_KV_PATTERNS = 16
_MAX_BLOCKS = 3
_ABORT_WITHIN_S = 0.004  # an abort fires this long at most after the request started on that side
_GUARD_HOLD_S = 0.03
_TICK_S = 0.0002


@dataclass(frozen=True, slots=True)
class Planned:
    tid: str
    blocks: int
    num_tokens: int
    kv_seed: int
    d_abort_s: float | None
    p_abort_s: float | None


def schedule(spec: KVSpec, seed: int, n: int) -> list[Planned]:
    """The same list in both workers (only ``seed`` and ``n`` cross the process boundary)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        blocks = rng.randint(1, _MAX_BLOCKS)
        num_tokens = (blocks - 1) * spec.block_size + rng.randint(1, spec.block_size)
        roll = rng.random()
        d_abort = rng.uniform(0, _ABORT_WITHIN_S) if roll < 0.5 else None
        p_abort = rng.uniform(0, _ABORT_WITHIN_S) if 0.3 < roll < 0.75 else None
        out.append(Planned(f"r{i}", blocks, num_tokens, i % _KV_PATTERNS, d_abort, p_abort))
    return out


@dataclass
class _Live:
    plan: Planned
    blocks: list[int]
    abort_at: float | None


@dataclass
class _Guard:
    blocks: list[int]
    byte: int
    until: float


@dataclass
class _Side:
    """What both halves share: the schedule, the pool, the in-flight table, the bounded loop."""

    setup: EngineSetup
    plans: list[Planned]
    window: int
    rng: random.Random
    free: deque[int] = field(default_factory=deque)
    live: dict[str, _Live] = field(default_factory=dict)
    next_i: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts.update(corrupted_ready_bytes=0, corrupted_guard_bytes=0)
        self.free.extend(range(self.setup.ranks[0].cache.num_blocks))
        spec = self.setup.engine.spec
        self.kvs = [random_kv(spec, _MAX_BLOCKS * spec.block_size, s) for s in range(_KV_PATTERNS)]

    def bump(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def kv(self, plan: Planned) -> np.ndarray:
        return self.kvs[plan.kv_seed][:, :, :, : plan.num_tokens]

    def take(self, abort_s: float | None) -> tuple[Planned, list[int], float | None] | None:
        if self.next_i >= len(self.plans) or len(self.live) >= self.window:
            return None
        plan = self.plans[self.next_i]
        if len(self.free) < plan.blocks:
            return None
        self.next_i += 1
        blocks = [self.free.popleft() for _ in range(plan.blocks)]
        abort_at = None if abort_s is None else time.monotonic() + abort_s
        self.live[plan.tid] = _Live(plan, blocks, abort_at)
        return plan, blocks, abort_at

    def due_aborts(self) -> list[str]:
        now = time.monotonic()
        due = [tid for tid, r in self.live.items() if r.abort_at is not None and now >= r.abort_at]
        for tid in due:
            self.live[tid].abort_at = None
        return due

    def slab_bytes(self) -> list[np.ndarray]:
        return [rank.own_cache().slab.view(np.uint8) for rank in self.setup.ranks]

    def result(self) -> dict[str, Any]:
        return {
            "started": self.next_i,
            "stuck": sorted(self.live)[:5],
            "n_stuck": len(self.live),
        } | self.counts


def race_p(
    conn: Producer, setup: EngineSetup, seed: int, n: int, window: int, limit_s: float
) -> dict[str, Any]:
    side = _Side(setup, schedule(setup.engine.spec, seed, n), window, random.Random(seed + 1))
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and (side.next_i < n or side.live):
        while (got := side.take(side.plans[side.next_i].p_abort_s if side.next_i < n else None)) is not None:
            plan, blocks, _ = got
            scatter_tokens(setup.ranks, blocks, side.kv(plan))
            conn.request_finished(plan.tid, blocks, plan.num_tokens)
        for tid in side.due_aborts():
            conn.abort(tid)
            side.bump("p_aborts")
        for ev in conn.poll():
            r = side.live.pop(ev.transfer_id)
            side.bump(f"p_{ev.outcome.value}")
            byte = side.rng.randint(1, 255)  # reuse at once: a write still reading would carry this to D
            for slab in side.slab_bytes():
                slab[:, :, r.blocks] = byte
            side.free.extend(r.blocks)
        time.sleep(_TICK_S)
    return side.result()


def race_d(
    conn: Consumer, setup: EngineSetup, seed: int, n: int, window: int, limit_s: float, remote: dict[str, Any]
) -> dict[str, Any]:
    side = _Side(setup, schedule(setup.engine.spec, seed, n), window, random.Random(seed + 2))
    p = RemoteEngine(**remote)
    guards: deque[_Guard] = deque()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and (side.next_i < n or side.live or guards):
        while (got := side.take(side.plans[side.next_i].d_abort_s if side.next_i < n else None)) is not None:
            plan, blocks, _ = got
            conn.request_allocated(plan.tid, blocks, plan.num_tokens, 0, p)
        for tid in side.due_aborts():
            conn.abort(tid)
            side.bump("d_aborts")
        now = time.monotonic()
        for ev in conn.poll():
            if ev.kind is ConsumerEventKind.FAILED:
                continue
            r = side.live.pop(ev.transfer_id)
            if ev.kind is ConsumerEventKind.READY:
                side.bump("ready")
                got_kv = gather_tokens(setup.ranks, r.blocks, range(r.plan.num_tokens))
                want = np.ascontiguousarray(side.kv(r.plan)).view(np.uint8)
                side.bump("corrupted_ready_bytes", int(np.count_nonzero(got_kv.view(np.uint8) != want)))
            else:
                side.bump("released")
            byte = side.rng.randint(1, 255)  # reuse at once, for another request's known bytes
            for slab in side.slab_bytes():
                slab[:, :, r.blocks] = byte
            guards.append(_Guard(r.blocks, byte, now + side.rng.uniform(0, _GUARD_HOLD_S)))
        _check_guards(side, guards, force=time.monotonic() >= deadline)
        time.sleep(_TICK_S)
    _check_guards(side, guards, force=True)
    return side.result()


def _check_guards(side: _Side, guards: deque[_Guard], *, force: bool) -> None:
    now = time.monotonic()
    for _ in range(len(guards)):
        g = guards.popleft()
        if not force and g.until > now:
            guards.append(g)
            continue
        for slab in side.slab_bytes():
            side.bump("corrupted_guard_bytes", int(np.count_nonzero(slab[:, :, g.blocks] != g.byte)))
            side.bump("guard_bytes_checked", int(slab[:, :, g.blocks].size))
            slab[:, :, g.blocks] = 0
        side.bump("guards_checked")
        side.free.extend(g.blocks)
