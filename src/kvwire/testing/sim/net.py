"""The simulated world: a virtual clock, an event queue, a network of agents with faults, and memory.

Nothing here waits: ``World.run_until`` pops events in time order (ties broken by insertion order, so a
seed replays byte for byte). Every engine lives on ``World``; agents are named as NIXL agents are
(``engine/incarnation/ppX/tpY``), notifications are raw encoded bytes, and a write copies real bytes from
one ``KVCache`` slab to another at the moment it lands (``ctypes.memmove``), after the invariant checks.
"""

from __future__ import annotations

import bisect
import ctypes
import heapq
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvwire.testing.sim.engines import SimEngine

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class Faults:
    """Fault rates (per event) and magnitudes; all zero is a fault-free run."""

    delay: float = 0.0  # a notification delayed by up to delay_max_s
    delay_max_s: float = 0.05
    duplicate: float = 0.0  # a notification delivered twice
    reorder: float = 0.0  # a notification overtaken by later ones (large jitter)
    # A notification lost outside any partition. NIXL's notifications are reliable while the link is up,
    # so the chaos mix leaves it at 0: a lost done or cancel would be a transport bug, not a fault.
    drop: float = 0.0
    slow_write: float = 0.0  # a write taking up to slow_write_max_s
    slow_write_max_s: float = 0.5
    failed_write: float = 0.0
    stuck_write: float = 0.0  # a write that never completes (released by a timeout)
    failed_post: float = 0.0
    # A released write still in flight lands part of its bytes as it is cancelled (seen on real NIXL
    # after a thaw: 33-124 KB landed): the quarantine must cover it.
    release_lands: float = 0.0
    # ... and arrives up to this late (after the partition, if one cuts the pair): a link draining what the
    # kernels held after P recalled the write, which D's grace after P's word must cover (0: at once).
    release_drain_max_s: float = 0.0
    failed_handshake: float = 0.0
    partition: float = 0.0  # per second of simulated time: a P-D pair partitioned for up to 8 s
    pause: float = 0.0  # per second: an engine frozen for up to 10 s
    crash: float = 0.0  # per second: an engine crashes and restarts with a new incarnation
    abort: float = 0.0  # per request: aborted at a random moment on P or D
    # Per request: D drops it before allocating its blocks (a client gone while it queued) and tells P
    # (``Decline``), which frees the prompt's blocks then rather than at its lease.
    decline: float = 0.0

    @classmethod
    def chaos(cls) -> Faults:
        return cls(
            delay=0.05,
            duplicate=0.02,
            reorder=0.02,
            slow_write=0.05,
            failed_write=0.01,
            stuck_write=0.002,
            failed_post=0.01,
            release_lands=0.3,
            release_drain_max_s=0.5,
            failed_handshake=0.01,
            partition=0.05,
            pause=0.05,
            crash=0.02,
            abort=0.05,
            decline=0.02,
        )


@dataclass
class Region:
    addr: int
    block_len: int
    num_blocks: int


class MemoryMap:
    """Which engine block a destination address falls in (for the C1 check)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[Region, SimEngine]] = []

    def add(self, region: Region, engine: SimEngine) -> None:
        i = bisect.bisect(self._starts, region.addr)
        self._starts.insert(i, region.addr)
        self._regions.insert(i, (region, engine))

    def remove(self, engine: SimEngine) -> None:
        keep = [(r, e) for r, e in self._regions if e is not engine]
        self._regions = keep
        self._starts = [r.addr for r, _ in keep]

    def spans(self, rows: np.ndarray) -> list[tuple[SimEngine | None, int, int]]:
        """Where each ``[n, 3]`` (addr, len, dev) row lands: (engine, first block, last block), engine None
        outside every live cache. One pass with the lookups bound locally: a landing has dozens of rows
        (small numpy arrays cost more per call than this loop does per row)."""
        starts, regions, find = self._starts, self._regions, bisect.bisect
        out: list[tuple[SimEngine | None, int, int]] = []
        for addr, length, _ in rows.tolist():
            i = find(starts, addr) - 1
            if i < 0:
                out.append((None, 0, -1))
                continue
            region, engine = regions[i]
            base, block_len = region.addr, region.block_len
            last = (addr + length - 1 - base) // block_len
            if last >= region.num_blocks:
                out.append((None, 0, -1))
            else:
                out.append((engine, (addr - base) // block_len, last))
        return out


class World:
    """Clock, queue, RNG, agents, partitions and the record of what went wrong."""

    def __init__(self, seed: int, faults: Faults) -> None:
        self.seed = seed
        self.rng = random.Random(seed)  # per event: latencies, message and write faults
        # The schedule: arrivals, each request's shape and fate, partitions, pauses and crashes. A stream of
        # its own, drawn the same way whatever the cores do, so that two variants of a core (a breaker on
        # and off, say) meet the same requests and the same faults under one seed: an A/B comparison.
        self.plan = random.Random(f"kvwire-sim-schedule-{seed}")
        self.faults = faults
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.agents: dict[str, SimEngine] = {}  # agent name -> engine (its current life)
        self.addresses: dict[tuple[str, int], SimEngine] = {}
        self.memory = MemoryMap()
        self.partitions: dict[frozenset[str], float] = {}  # engine ids -> healed at
        self.violations: list[str] = []
        self.fault_counts: Counter[str] = Counter()
        # With ``meter_cores``, the CPU time spent inside the cores' ``handle`` (connector and handshake
        # cores): the cores' share of a run, apart from the simulator's own network, memory and checks.
        self.meter_cores = False
        self.core_cpu_s = 0.0
        # ...and by (core, input) kind: (seconds, inputs). Where the cores' CPU goes: issue 21's profile.
        self.core_cpu_by: dict[tuple[str, str], list[float]] = {}
        # (P agent, D agent, transfer id) of every registration P ended by notification (push mode).
        self.ended: set[tuple[str, str, str]] = set()

    # -- time --------------------------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run_until(self, end: float, stop: Callable[[], bool] | None = None) -> None:
        queue, pop = self._queue, heapq.heappop
        while queue and queue[0][0] <= end:
            self.now, _, fn = pop(queue)
            fn()
            if stop is not None and stop():
                return
        self.now = max(self.now, end)

    def chance(self, p: float, kind: str, rng: random.Random | None = None) -> bool:
        if p > 0 and (rng or self.rng).random() < p:
            self.fault_counts[kind] += 1
            return True
        return False

    def violation(self, what: str) -> None:
        self.violations.append(f"t={self.now:.6f} {what}")

    def ending_sent(self, sender: str, receiver: str, transfer_id: str, what: str) -> None:
        """One registration, one ending message (``done``, ``cancel_ack`` or ``failed``): a second one
        from the same P agent to the same D agent for one transfer is a protocol violation, counted before
        the network duplicates anything."""
        key = (sender, receiver, transfer_id)
        if key in self.ended:
            self.violation(f"one ending message: {what} for {transfer_id} from {sender} after another")
        self.ended.add(key)

    # -- network -----------------------------------------------------------------------------------------
    def partitioned(self, a: str, b: str) -> bool:
        healed = self.partitions.get(frozenset((a, b)))
        return healed is not None and healed > self.now

    def deliver(self, src: SimEngine, dst_agent: str, raw: bytes, sender: str) -> None:
        """Carry one notification; latency, delay, reorder, duplicate and drop faults apply here."""
        f = self.faults
        latency = 20e-6 + self.rng.random() * 80e-6
        if self.chance(f.delay, "delay"):
            latency += self.rng.random() * f.delay_max_s
        if self.chance(f.reorder, "reorder"):
            latency += self.rng.random() * 0.01
        copies = 2 if self.chance(f.duplicate, "duplicate") else 1
        dst = self.agents.get(dst_agent)
        if dst is None:
            return
        if self.partitioned(src.engine_id, dst.engine_id):
            self.fault_counts["dropped_in_partition"] += 1
            return
        if self.chance(f.drop, "drop"):
            return
        for i in range(copies):
            self.after(latency * (1 + i), lambda: self._arrive(dst, dst_agent, sender, raw))

    def _arrive(self, dst: SimEngine, dst_agent: str, sender: str, raw: bytes) -> None:
        if self.agents.get(dst_agent) is dst:  # the life it was sent to is still there
            dst.notif_in(dst_agent, sender, raw)

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Land a write's bytes: ``[n, 3]`` (addr, len, dev) rows, local source to remote destination."""
        move = ctypes.memmove
        for s_addr, length, d_addr in zip(
            src[:, 0].tolist(), src[:, 1].tolist(), dst[:, 0].tolist(), strict=True
        ):
            move(d_addr, s_addr, length)


def metered(world: World, handle: Callable[[float, In], list[Out]]) -> Callable[[float, In], list[Out]]:
    """``handle`` (a bound method of a core) adding its thread CPU time to ``world.core_cpu_s`` and to
    ``world.core_cpu_by[(core class, input class)]`` (``handle`` returns its actions before any runs, so
    the time is the core's alone)."""
    core = type(getattr(handle, "__self__", handle)).__name__
    by = world.core_cpu_by

    def timed(now: float, inp: In) -> list[Out]:
        t0 = time.thread_time()
        try:
            return handle(now, inp)
        finally:
            spent = time.thread_time() - t0
            world.core_cpu_s += spent
            slot = by.setdefault((core, type(inp).__name__), [0.0, 0.0])
            slot[0] += spent
            slot[1] += 1

    return timed
