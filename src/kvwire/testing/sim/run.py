"""A deterministic simulation of P and D engines running kvwire's real cores, with a seeded fault schedule.

``simulate(requests, seed)`` builds two P engines (TP1/PP1 and TP2/PP2) and two D engines (TP1, TP2),
sends ``requests`` through them (each from one P to one D), injects the faults of ``Faults`` and checks,
on every step and at the end:

* C1: no byte lands in a block not registered to that transfer at that moment (``SimEngine._check_landing``);
* every request reaches a terminal state within its bound;
* every block is freed exactly once, and none is leaked at quiescence (cores empty, blocks all free);
* no event twice (D: READY | FAILED, RELEASED | RELEASED; P: one freeable event per ``Finished``);
* a READY request's bytes are P's bytes (compared byte for byte);
* one ending message per registration: P sends a D agent at most one ``done`` (a write's included),
  ``cancel_ack`` or ``failed`` per transfer (``World.ending_sent``);
* no core raises.

A failing seed replays byte for byte: everything random comes from one ``random.Random(seed)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvwire.core.base import CoreBase
from kvwire.core.config import ConnectorConfig
from kvwire.core.consumer import PushConsumerCore
from kvwire.core.consumer_pull import PullConsumerCore
from kvwire.core.events import ConsumerEvent, ConsumerEventKind, ProducerEvent
from kvwire.core.io import Abort, Allocated, Decline, Finished, LayersReady, RemoteEngine, StepEnded
from kvwire.core.producer import ProducerCore, PullProducerCore
from kvwire.core.producer_layers import LayerwisePushProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.mapping import RankLayout
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.ranks import RankKey
from kvwire.testing.engines import gather_tokens, scatter_tokens
from kvwire.testing.sim.engines import SimEngine
from kvwire.testing.sim.net import Faults, World
from kvwire.testing.sim.report import Report

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=4, dtype="float8", block_size=4)


@dataclass(frozen=True)
class Shapes:
    """The simulated engines' parallelism: each P's (tp, pp), each D's tp (D runs no PP)."""

    ps: tuple[tuple[int, int], ...] = ((1, 1), (2, 2))
    ds: tuple[int, ...] = (1, 2)


MAX_TOKENS = 48
CONFIG = ConnectorConfig(
    kv_lease_duration_s=10.0,
    fence_ms=5_000,
    transfer_timeout_s=10.0,
    tombstone_s=20.0,
    handshake_timeout_s=2.0,
    # A quarter of READY requests have their bytes checked against P's digest too (kv/digest.py), under
    # every fault (all of them would cost a third of the run's speed).
    kv_digest_sample=0.25,
)

CoreKind = type[CoreBase]


@dataclass
class Plant:
    """Core classes to run instead of the real ones (a planted bug), by side."""

    producer: CoreKind | None = None
    consumer: CoreKind | None = None


@dataclass
class _Req:
    tid: str
    number: int
    p: SimEngine
    d: SimEngine
    tokens: int
    cached: int
    started: float
    p_blocks: list[int] = field(default_factory=list)
    d_blocks: list[int] = field(default_factory=list)
    p_life: int = 0
    d_life: int = 0
    finished: bool = False  # P told its core
    p_aborted: bool = False
    streaming: bool = False  # layer-wise: P's engine is in the step that computes the request's layers
    abort_at_step_end: bool = False  # layer-wise: aborted during that step (the engine frees after it)
    between_steps: bool = False  # layer-wise: the step ended, request_finished comes with the next one
    p_freed: bool = False
    d_events: list[ConsumerEventKind] = field(default_factory=list)
    d_done: float | None = None
    p_done: float | None = None
    p_incarnation: str = ""  # P's life at submit: the one that prefills
    p_wire_id: str = ""  # and its engine id, as P's answer names it
    d_after: float = 0.0  # when D allocates, after submit (push) or after P's prefill (pull)
    declined: bool = False  # ... or declines instead (Faults.decline)


def _ranks(engine: SimEngine) -> list[LocalRank]:
    # The gather/scatter helpers only read ``cache``; the sim's engines have no agent objects.
    return [LocalRank(k[0], k[1], None, c) for k, c in engine.caches.items()]  # type: ignore[arg-type]


class Simulation:
    def __init__(
        self,
        seed: int,
        faults: Faults,
        mode: TransferMode,
        plant: Plant | None = None,
        meter_cores: bool = False,
        layerwise: bool = False,
        spec: KVSpec = SPEC,
        shapes: Shapes = Shapes(),
    ) -> None:
        if layerwise and mode is not TransferMode.PUSH:
            raise ValueError("layer-wise transfer is a push mode")
        self.world = World(seed, faults)
        self.world.meter_cores = meter_cores  # before the engines: their cores are wrapped as they start
        self.mode = mode
        self.layerwise = layerwise
        self.plant = plant or Plant()
        self.spec = spec
        rng = np.random.default_rng(seed)
        shape = (spec.num_layers, 2, spec.kv_heads, MAX_TOKENS, spec.head_dim)
        self._base = rng.integers(0, 256, size=shape).astype(np.uint8)
        self.reqs: dict[str, _Req] = {}
        self.outcomes: Counter[str] = Counter()
        self.open_sides = 0  # request sides (P, D) not ended yet
        self.engines: list[SimEngine] = []
        self.ps = [self._engine(f"P{i}", tp, pp, producer=True) for i, (tp, pp) in enumerate(shapes.ps)]
        self.ds = [self._engine(f"D{i}", tp, 1, producer=False) for i, tp in enumerate(shapes.ds)]

    def _engine(self, name: str, tp: int, pp: int, *, producer: bool) -> SimEngine:
        push = self.mode is TransferMode.PUSH
        if producer:
            real = LayerwisePushProducerCore if self.layerwise else PushProducerCore
            kind = self.plant.producer or (real if push else PullProducerCore)
        else:
            kind = self.plant.consumer or (PushConsumerCore if push else PullConsumerCore)

        def make(
            info: EngineInfo, layouts: dict[RankKey, RankLayout], n: int, cfg: ConnectorConfig, host: str
        ) -> CoreBase:
            return kind(info, layouts, n, cfg, host=host)

        handler: Callable[[SimEngine, object], None] = self._p_event if producer else self._d_event
        config = dataclasses.replace(CONFIG, mode=self.mode, layerwise=self.layerwise)
        engine = SimEngine(
            self.world, name, 9000 + len(self.engines), self.spec, tp=tp, pp=pp, num_blocks=4096,
            mode=self.mode, config=config, make_core=make, on_event=handler,
        )  # fmt: skip
        self.engines.append(engine)
        return engine

    def kv(self, req: _Req) -> np.ndarray:
        out: np.ndarray = self._base[:, :, :, : req.tokens, :] ^ np.uint8(req.number % 251)
        return out

    # -- requests ------------------------------------------------------------------------------------------
    def submit(self, number: int) -> None:
        w, plan = self.world, self.world.plan
        # Every draw first, whatever happens to the request: the schedule stream stays the same.
        tokens = plan.randint(1, MAX_TOKENS)
        cached = 0
        bs = self.spec.block_size
        if tokens > bs and plan.random() < 0.2:
            cached = bs * plan.randint(1, (tokens - 1) // bs)
        p, d = plan.choice(self.ps), plan.choice(self.ds)
        prefill, d_after = 0.5e-3 + plan.random() * 10e-3, plan.random() * 2e-3
        abort = w.chance(w.faults.abort, "abort", plan)
        side, abort_after = plan.choice(("p", "d")), plan.random() * 20e-3
        req = _Req(f"r{number}", number, p, d, tokens, cached, w.now, p_life=p.life, d_life=d.life)
        req.p_incarnation, req.p_wire_id = p.incarnation, p.wire_id
        req.d_after, req.declined = d_after, w.chance(w.faults.decline, "decline", plan)
        n = math.ceil(tokens / bs)
        p_blocks = p.allocate(req.tid, n)
        if p_blocks is None:
            self.outcomes["no_p_blocks"] += 1
            return
        d_blocks = d.allocate(req.tid, n)
        if d_blocks is None:
            p.release(req.tid, p_blocks)
            self.outcomes["no_d_blocks"] += 1
            return
        req.p_blocks, req.d_blocks = p_blocks, d_blocks
        self.reqs[req.tid] = req
        self.open_sides += 2
        if self.layerwise:  # the prefill's last step is its second half
            w.after(prefill / 2, lambda: self._step(req, prefill / 2))
        else:
            w.after(prefill, lambda: self._prefilled(req))
        if self.mode is TransferMode.PUSH:
            w.after(d_after, lambda: self._allocate_d(req))
        if abort:
            w.after(abort_after, lambda: self._abort(req, side))

    def _no_decode_leg(self, req: _Req) -> None:
        """Pull: the prefill leg failed, so the router never sends the decode leg: D frees its blocks."""
        if self.mode is TransferMode.PULL and req.d_done is None:
            self._d_ended(req)
            req.d_events.append(ConsumerEventKind.RELEASED)
            self._free_d(req)

    def _remote(self, req: _Req) -> RemoteEngine:
        blocks = tuple(req.p_blocks) if self.mode is TransferMode.PULL else ()
        # The life that prefilled, as P's answer names it (a P restarted since must be refused).
        incarnation = req.p_incarnation
        return RemoteEngine(
            req.p_wire_id, "sim", req.p.port, req.p.tp, req.p.pp, blocks, incarnation=incarnation
        )

    def _allocate_d(self, req: _Req) -> None:
        if req.d.life != req.d_life:
            return
        if req.declined:  # D drops it before allocating: its blocks never reach kvwire, P is told
            self.outcomes["d_declined"] += 1
            self._d_ended(req)
            req.d_events.append(ConsumerEventKind.RELEASED)
            self._free_d(req)
            req.d.feed(Decline(req.tid, self._remote(req)))
            return
        req.d.writable.add(req.tid)
        remote = self._remote(req)
        req.d.feed(Allocated(req.tid, tuple(req.d_blocks), req.tokens, req.cached, remote))

    def _prefilled(self, req: _Req) -> None:
        p = req.p
        if p.life != req.p_life or req.p_aborted:
            self._no_decode_leg(req)
            return
        scatter_tokens(_ranks(p), req.p_blocks, self.kv(req))
        self._finish(req)

    def _finish(self, req: _Req) -> None:
        req.finished, req.between_steps = True, False
        req.p.feed(Finished(req.tid, tuple(req.p_blocks), req.tokens))
        if self.mode is TransferMode.PULL:
            self.world.after(req.d_after, lambda: self._allocate_d(req))

    # -- layer-wise push: the prefill's last step, one layer at a time ---------------------------------------
    def _step(self, req: _Req, duration: float) -> None:
        """The step that computes the request's layers starts: its blocks hold wrong bytes but in the layers
        computed so far, each told to P's core as it is (``LayersReady``: vLLM's ``save_kv_layer``)."""
        p = req.p
        if p.life != req.p_life or req.p_aborted:
            return
        req.streaming = True
        scatter_tokens(_ranks(p), req.p_blocks, ~self.kv(req))  # not computed yet: every byte differs
        n = self.spec.num_layers
        for layer in range(n):
            self.world.after(duration * (layer + 1) / (n + 1), lambda ly=layer: self._layer(req, ly))  # type: ignore[misc]
        deadline = self.world.now + duration + CONFIG.transfer_timeout_s
        self.world.after(duration, lambda: self._step_over(req, deadline, CONFIG.poll_interval_s))

    def _layer(self, req: _Req, layer: int) -> None:
        p = req.p
        if p.life != req.p_life:
            return
        if p.paused:  # a frozen process computes nothing
            self.world.at(p.paused_until, lambda: self._layer(req, layer))
            return
        scatter_tokens(_ranks(p), req.p_blocks, self.kv(req), layers=range(layer, layer + 1))
        p.feed(LayersReady(req.tid, tuple(req.p_blocks), req.tokens, (layer,)))

    def _step_over(self, req: _Req, deadline: float, poll: float) -> None:
        """vLLM's ``wait_for_save``: poll until none of the request's layer writes is in flight (at most
        until ``deadline``, on the engine's clock, which a freeze does not stop), then ``StepEnded``. The
        request then finishes (``Finished``); aborted during the step, the engine frees its blocks. The
        connector polls every ``poll_interval_s``; here the interval doubles up to 50 ms (a write stuck
        until the deadline would cost 20,000 polls), which only delays the step's end a little."""
        p, w = req.p, self.world
        if p.life != req.p_life:
            return
        if p.paused:
            w.at(p.paused_until, lambda: self._step_over(req, deadline, poll))
            return
        core = p.core
        if isinstance(core, LayerwisePushProducerCore) and core.streaming((req.tid,)) and w.now < deadline:
            w.after(poll, lambda: self._step_over(req, deadline, min(2 * poll, 0.05)))
            return
        req.streaming = False
        p.feed(StepEnded(req.tid))
        # The scheduler runs between two steps: it frees an aborted request's blocks at once (the next step
        # may reuse them), and the workers hear of the end (Abort, or request_finished) with the next step.
        gap = 1e-4 + w.rng.random() * 1e-3
        if req.abort_at_step_end:
            req.p_aborted = True
            self._free_p(req)
            self._no_decode_leg(req)
            w.after(gap, lambda: self._next_step(req, lambda: p.feed(Abort(req.tid))))
        else:
            req.between_steps = True
            w.after(gap, lambda: self._next_step(req, lambda: self._finish(req)))

    @staticmethod
    def _next_step(req: _Req, fn: Callable[[], None]) -> None:
        if req.p.life == req.p_life:  # the life that prefilled (a crash ended the request on P)
            fn()

    def _abort(self, req: _Req, side: str) -> None:
        if side == "p" and req.p.life == req.p_life and not req.p_freed:
            if req.streaming:  # mid-step: vLLM frees the blocks after the step (wait_for_save)
                req.abort_at_step_end = True
            elif req.between_steps:  # the scheduler already finished it: the abort follows request_finished
                self.world.after(2e-3, lambda: self._abort(req, side))
            elif not req.finished:  # still prefilling: the engine frees its own blocks
                self._abort_prefill(req)
            else:
                req.p.feed(Abort(req.tid))
        elif side == "d" and req.d.life == req.d_life and req.d_done is None:
            req.d.feed(Abort(req.tid))

    # -- events ----------------------------------------------------------------------------------------------
    def _abort_prefill(self, req: _Req) -> None:
        req.p_aborted = True
        self._free_p(req)
        self._no_decode_leg(req)
        req.p.feed(Abort(req.tid))

    def _p_event(self, engine: SimEngine, event: object) -> None:
        assert isinstance(event, ProducerEvent)
        req = self.reqs.get(event.transfer_id)
        if req is None or req.p_freed or not req.finished:
            self.world.violation(f"{engine.engine_id}: freeable event {event} unexpected or twice")
            return
        self.outcomes[f"p_{event.outcome.value}"] += 1
        self._free_p(req)

    def _free_p(self, req: _Req) -> None:
        req.p_freed = True
        self._p_ended(req)
        req.p.release(req.tid, req.p_blocks)

    def _d_event(self, engine: SimEngine, event: object) -> None:
        assert isinstance(event, ConsumerEvent)
        req = self.reqs.get(event.transfer_id)
        kind = event.kind
        if req is None or req.d_done is not None or (kind is ConsumerEventKind.READY and req.d_events):
            self.world.violation(
                f"{engine.engine_id}: {kind.value} for {event.transfer_id} unexpected or twice"
            )
            return
        req.d_events.append(kind)
        if kind is ConsumerEventKind.FAILED:
            return
        self._d_ended(req)
        engine.writable.discard(req.tid)
        self.outcomes[f"d_{kind.value}" + (f"_{event.reason.value}" if event.reason else "")] += 1
        if kind is ConsumerEventKind.READY:
            self._verify(req)
            if not req.finished:  # layer-wise: every layer landed before P's request_finished
                self.outcomes["d_ready_before_p_finished"] += 1
            # Decoding holds the blocks a while, then the engine frees them (and reuses them at once).
            self.world.after(1e-3 + self.world.rng.random() * 4e-3, lambda: self._free_d(req))
        else:
            self._free_d(req)

    def _free_d(self, req: _Req) -> None:
        if req.d.life == req.d_life:
            req.d.release(req.tid, req.d_blocks)

    def _verify(self, req: _Req) -> None:
        span = range(req.cached, req.tokens)
        if not span:
            return
        got = gather_tokens(_ranks(req.d), req.d_blocks, span)
        want = self.kv(req)[:, :, :, span.start : span.stop, :]
        if not np.array_equal(got.view(np.uint8), want):
            self.world.violation(f"{req.tid}: READY with bytes that are not P's")

    # -- faults over time ------------------------------------------------------------------------------------
    def _chaos_step(self, period: float) -> None:
        """Once per ``period`` of simulated time: maybe partition a pair, pause or crash an engine."""
        w, f, plan = self.world, self.world.faults, self.world.plan
        if w.chance(f.partition * period, "partition", plan):
            p, d = plan.choice(self.ps), plan.choice(self.ds)
            w.partitions[frozenset((p.engine_id, d.engine_id))] = w.now + plan.random() * 8.0
        if w.chance(f.pause * period, "pause", plan):
            plan.choice(self.engines).pause(plan.random() * 10.0)
        if w.chance(f.crash * period, "crash", plan):
            self._crash(plan.choice(self.engines), new_id=plan.random() < 0.5)

    def _crash(self, engine: SimEngine, *, new_id: bool) -> None:
        # The requests of the dead life are gone from this side; the other side must still end them.
        for req in self.reqs.values():
            if req.p is engine and req.p_life == engine.life and not req.p_freed:
                req.p_freed = True
                self._p_ended(req)
            if req.d is engine and req.d_life == engine.life and req.d_done is None:
                self._d_ended(req)
                req.d_events.append(ConsumerEventKind.RELEASED)
        self.outcomes["crash"] += 1
        self.outcomes["crash_new_id"] += new_id
        engine.crash(new_id)

    # -- the run ---------------------------------------------------------------------------------------------
    def bound_s(self) -> float:
        """How long any request may take to reach a terminal state, faults included."""
        c = CONFIG
        stalls = 10.0 + 8.0  # the longest pause and partition
        return (
            2 * c.handshake_timeout_s + c.fence_ms / 1e3 + c.transfer_timeout_s + c.kv_lease_duration_s
            + c.liveness_timeout_s + c.dead_peer_grace_s + c.dead_quarantine_s + 2 * c.heartbeat_interval_s
            + stalls
        )  # fmt: skip

    def run(self, requests: int, rate: float = 500.0, *, stop_at_first: bool = False) -> None:
        w = self.world
        stopped = (lambda: bool(w.violations)) if stop_at_first else None
        t = 0.0
        period = 0.1
        next_chaos = 0.0
        for number in range(requests):
            t += w.plan.expovariate(rate)
            while next_chaos <= t:
                w.at(next_chaos, lambda: self._chaos_step(period))
                next_chaos += period
            w.at(t, lambda n=number: self.submit(n))  # type: ignore[misc]
            if number % 256 == 255:
                w.run_until(t, stop=stopped)  # keep the queue short
                if w.violations and stop_at_first:
                    return
        w.run_until(t, stop=stopped)
        bound = self.bound_s()
        w.run_until(t + bound, stop=lambda: self._all_ended() or bool(stopped and stopped()))
        if w.violations and stop_at_first:
            return
        self._check_bounds(bound)
        # Quiescence: past every timer (tombstones, leases), nothing may stay held.
        w.run_until(w.now + CONFIG.tombstone_s + CONFIG.kv_lease_duration_s + 5.0)
        self._check_quiescent()
        # Blocks released at the quarantine bound, never confirmed: legitimate after a freeze or a
        # partition, but a crashed P's address answers (a new life) and must confirm it sooner.
        expired = sum(d.quarantines_expired() for d in self.ds)
        if expired:
            self.outcomes["d_quarantine_expired"] = expired

    def _all_ended(self) -> bool:
        return self.open_sides == 0

    def _p_ended(self, req: _Req) -> None:
        if req.p_done is None:
            req.p_done = self.world.now
            self.open_sides -= 1

    def _d_ended(self, req: _Req) -> None:
        if req.d_done is None:
            req.d_done = self.world.now
            self.open_sides -= 1

    def _check_bounds(self, bound: float) -> None:
        w = self.world
        for req in self.reqs.values():
            for side, done in (("P", req.p_done), ("D", req.d_done)):
                if done is None:
                    w.violation(
                        f"{req.tid}: {side} side not terminal {w.now - req.started:.1f} s after start"
                    )
                elif done - req.started > bound:
                    w.violation(
                        f"{req.tid}: {side} side ended after {done - req.started:.1f} s > {bound:.0f}"
                    )

    def _check_quiescent(self) -> None:
        for engine in self.engines:
            live = getattr(engine.core, "live_requests", 0)
            if live:
                self.world.violation(f"{engine.engine_id}: {live} requests still live at quiescence")
            early = getattr(engine.core, "early_registrations", 0), getattr(engine.core, "early_block_ids", 0)
            if any(early):  # the table a flood fills must empty with the requests, or its slots leak
                self.world.violation(f"{engine.engine_id}: {early} early registrations (block ids) left")
            core = engine.core
            if isinstance(core, ProducerCore) and core.records != core.recount():
                # The counts the table's bounds read must be the table's (records, tombstones', ids).
                self.world.violation(f"{engine.engine_id}: counted {core.records}, table {core.recount()}")
            if engine.owner:
                held = sorted(set(engine.owner.values()))[:5]
                self.world.violation(f"{engine.engine_id}: {len(engine.owner)} blocks leaked ({held} ...)")


def simulate(
    requests: int,
    seed: int,
    *,
    faults: Faults | None = None,
    mode: TransferMode = TransferMode.PUSH,
    plant: Plant | None = None,
    stop_at_first: bool = False,
    meter_cores: bool = False,
    layerwise: bool = False,
    spec: KVSpec = SPEC,
    shapes: Shapes = Shapes(),
) -> Report:
    """Run ``requests`` simulated requests under ``faults`` (default: ``Faults.chaos()``); with
    ``stop_at_first``, stop at the first violation (a planted bug's hunt); with ``meter_cores``, also
    measure the CPU inside the cores' ``handle`` (a timer call per input: the run itself gets slower).
    ``spec``: the model's KV geometry (one KV head: every head replicated on P's TP-2 engine, so D reads
    from one rank and tells the other, ``kv.mapping.tp_contacts``); ``shapes``: the engines' TP and PP."""
    started, cpu_started = time.perf_counter(), time.process_time()
    faults = Faults.chaos() if faults is None else faults
    sim = Simulation(seed, faults, mode, plant, meter_cores, layerwise, spec, shapes)
    kvwire_log = logging.getLogger("kvwire")
    level = kvwire_log.level
    kvwire_log.setLevel(logging.ERROR)  # the cores' warnings (peers declared dead...) are expected here
    try:
        sim.run(requests, stop_at_first=stop_at_first)
    finally:
        kvwire_log.setLevel(level)
    w = sim.world
    return Report(
        requests=requests,
        seed=seed,
        mode=mode.value,
        layerwise=layerwise,
        violations=w.violations,
        faults=dict(w.fault_counts),
        outcomes=dict(sim.outcomes),
        wall_seconds=time.perf_counter() - started,
        cpu_seconds=time.process_time() - cpu_started,
        simulated_seconds=w.now,
        core_cpu_seconds=w.core_cpu_s if meter_cores else None,
        core_cpu_by={k: (cpu, int(count)) for k, (cpu, count) in w.core_cpu_by.items()},
    )
