"""``kvwire bench overhead``: control-plane CPU time per request on P and on D, excluding byte movement.

One process holds a P engine and a D engine (one rank each), on the in-process backend or on real NIXL.
On NIXL each connector runs its own loop thread by default (``--loops own``), as in an engine process:
intervals under 1 ms are then slept exactly, so the ticks a request costs are the deployed ones.
``--loops shared`` puts both on one loop (the in-process backend always does: its agents are not
thread-safe), where asyncio's epoll wait rounds each of those intervals up to 1 ms: fewer ticks, a lower
figure than an engine pays (figures before this option were measured that way).

The bench's thread waits for each batch's end as an engine does: woken by the connectors' ``on_event``
(``--wait event``, the default), or by polling both sides every 200 us (``--wait poll``, as figures
before this option were measured, when the loop also slept 200 us more after the poll that saw the
batch end: about 0.3 ms of every c1 ``wall_us`` before 2026-12-06 was the bench's own).

Requests move one tiny block (a few hundred bytes per region, Llama-3-8B's 32 layers by default, so a
request still posts one descriptor per (layer, kind) region): what is measured is kvwire's bookkeeping,
not bytes. After warm-up requests (handshakes done, peers cached), ``--requests`` requests run in
closed-loop batches of ``--concurrency``.

Per side, CPU time is metered with ``time.thread_time`` (the CPU of the thread that runs the code):

* ``*_loop_us``: everything the connector runs on the loop thread for that side (engine calls handed
  over, notification handling, transfer polling, timers, idle ticks), per request;
* ``*_call_us``: the engine-thread call sites (``request_allocated`` / ``request_finished``, ``poll``);
* ``*_transfer_us``: the part of ``*_loop_us`` inside the agent's transfer calls (post, status,
  release: NIXL or the in-process backend moving bytes); ``*_message_us``: inside its notification calls
  (send_notif, drain_notifs, progress), which count as control plane;
* ``*_us`` = loop + call - transfer: the figure against the goal (300 us);
* ``*_net_us``: ``*_us`` less what the side's polling burns when idle (measured first, ``IDLE_S``) over
  the same wall time: the requests' own cost, without the ticker's floor;
* ``loop_thread_us``: the loop threads' whole CPU time per request (both sides, and asyncio itself).

``--profile`` runs cProfile on the loop thread (P's, with own loops) during the measured requests and
prints the top entries, timed in the thread's CPU time (wall time would rank the idle ``epoll`` wait and
GIL hand-overs first).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import os
import pstats
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvwire.connector import (
    ConnectorConfig,
    Consumer,
    ConsumerEvent,
    ConsumerEventKind,
    Producer,
    ProducerEvent,
    ProducerOutcome,
    RemoteEngine,
)
from kvwire.handshake.loop import BackgroundLoop
from kvwire.kv.spec import KVSpec
from kvwire.testing.engines import EngineSetup, build_engine
from kvwire.transport.base import Agent
from kvwire.transport.inproc import InprocFabric
from kvwire_tools.bench.common import bar_plot, envelope, print_table, write_json

GOAL_US = 300.0
WAIT_S = 30.0
# Agent calls that move bytes (post, poll, release a transfer) and those that carry the control plane's
# notifications; the first are excluded from the control-plane figure.
_TRANSFER_CALLS = ("post", "post_array", "status", "release")
_MESSAGE_CALLS = ("send_notif", "drain_notifs", "progress")
IDLE_S = 0.5
POLL_S = 0.0002  # --wait poll: the bench's poll period
EVENT_WAIT_S = 0.01  # --wait event: a bound on one wait (events are the wake-up; this only guards one lost)
T = TypeVar("T")
_ids = itertools.count()


@dataclass
class Meter:
    """Thread CPU seconds spent in metered calls (outermost call only: nested ones are inside it)."""

    cpu_s: float = 0.0
    depth: int = 0

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.depth:
            return fn(*args, **kwargs)
        self.depth += 1
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.cpu_s += time.thread_time() - t0
            self.depth -= 1

    def timed(self, fn: Callable[..., T]) -> Callable[..., T]:
        return functools.partial(self.call, fn)


@dataclass
class SideMeters:
    loop: Meter = field(default_factory=Meter)
    transfer: Meter = field(default_factory=Meter)  # inside loop: the agent moving bytes
    message: Meter = field(default_factory=Meter)  # inside loop: the agent sending/receiving notifications
    call: Meter = field(default_factory=Meter)

    def reset(self) -> None:
        for m in (self.loop, self.transfer, self.message, self.call):
            m.cpu_s = 0.0


class _MeteredProducer(Producer):
    meter = Meter()

    def _guarded(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        # Every piece of connector work on the loop thread enters through _guarded (ticks, engine calls
        # handed over, handshake callbacks).
        self.meter.call(super()._guarded, fn, args)


class _MeteredConsumer(Consumer):
    meter = Meter()

    def _guarded(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.meter.call(super()._guarded, fn, args)


def _meter_agent(agent: Agent, meters: SideMeters) -> None:
    for names, meter in ((_TRANSFER_CALLS, meters.transfer), (_MESSAGE_CALLS, meters.message)):
        for name in names:
            setattr(agent, name, meter.timed(getattr(agent, name)))


@dataclass(frozen=True, slots=True)
class Case:
    backend: str
    concurrency: int
    requests: int
    own_loops: bool = True  # each connector on its own loop thread (NIXL only)
    wait_event: bool = True  # the bench sleeps until a connector's on_event, as an engine does

    @property
    def name(self) -> str:
        shared = "" if self.own_loops or self.backend == "inproc" else "-shared"
        return f"{self.backend}-c{self.concurrency}{shared}"


class Rig:
    """P and D engines in this process, their connectors on their own loops or one shared loop, every
    side metered."""

    def __init__(
        self, backend: str, spec: KVSpec, num_blocks: int, own_loops: bool = True, wait_event: bool = True
    ) -> None:
        n = next(_ids)
        fabric = InprocFabric() if backend == "inproc" else None
        self.spec = spec
        self.p: EngineSetup = build_engine(
            f"P{n}", spec, num_blocks=num_blocks, backend=backend, fabric=fabric
        )
        self.d: EngineSetup = build_engine(
            f"D{n}", spec, num_blocks=num_blocks, backend=backend, fabric=fabric
        )
        # The in-process agents are not thread-safe: one loop for both.
        shared = None if own_loops and fabric is None else BackgroundLoop(name="kvwire-bench")
        self._shared = shared
        cfg = ConnectorConfig()
        self.pm, self.dm = SideMeters(), SideMeters()
        self.producer = _MeteredProducer(self.p.engine, self.p.ranks, cfg, loop=shared)
        self.consumer = _MeteredConsumer(self.d.engine, self.d.ranks, cfg, loop=shared)
        self.producer.meter, self.consumer.meter = self.pm.loop, self.dm.loop
        # Set from either loop thread at every event; None: poll every POLL_S instead.
        self._woken: threading.Event | None = threading.Event() if wait_event else None
        if self._woken is not None:
            self.producer.on_event(self._woken.set)
            self.consumer.on_event(self._woken.set)
        _meter_agent(self.p.ranks[0].agent, self.pm)
        _meter_agent(self.d.ranks[0].agent, self.dm)
        port = self.producer.start()
        self.consumer.start()
        self.remote = RemoteEngine(self.p.engine.engine_id, "127.0.0.1", port)
        self._finished = self.pm.call.timed(self.producer.request_finished)
        self._allocated = self.dm.call.timed(self.consumer.request_allocated)
        self._p_poll = self.pm.call.timed(self.producer.poll)
        self._d_poll = self.dm.call.timed(self.consumer.poll)

    @property
    def loops(self) -> list[BackgroundLoop]:
        """The loop threads the connectors run on (one when shared)."""
        if self._shared is not None:
            return [self._shared]
        return [c for c in (self.producer.background_loop, self.consumer.background_loop) if c is not None]

    def loop_thread_cpu(self) -> float:
        async def read() -> float:
            return time.thread_time()

        return sum(loop.run(read(), WAIT_S) for loop in self.loops)

    def batch(self, tids: Sequence[str]) -> None:
        """Run requests to their end: D allocates, P finishes, both sides report."""
        tokens = self.spec.block_size
        for i, tid in enumerate(tids):
            self._allocated(tid, [i], tokens, 0, self.remote)
        for i, tid in enumerate(tids):
            self._finished(tid, [i], tokens)
        p_left, d_left = set(tids), set(tids)
        deadline = time.monotonic() + WAIT_S
        woken = self._woken
        while p_left or d_left:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(p_left)} P and {len(d_left)} D requests did not end")
            if woken is not None:
                woken.clear()  # before the polls: an event after them still ends the wait below
            for pe in self._p_poll():
                _expect(isinstance(pe, ProducerEvent) and pe.outcome is ProducerOutcome.SENT, pe)
                p_left.discard(pe.transfer_id)
            for de in self._d_poll():
                _expect(isinstance(de, ConsumerEvent) and de.kind is ConsumerEventKind.READY, de)
                d_left.discard(de.transfer_id)
            if not (p_left or d_left):
                break
            if woken is None:
                time.sleep(POLL_S)
            else:
                woken.wait(EVENT_WAIT_S)

    def reset(self) -> None:
        self.pm.reset()
        self.dm.reset()

    def idle_rates(self, seconds: float) -> tuple[float, float]:
        """CPU seconds per second each side's loop burns with no request at all (its polling)."""
        self.reset()
        time.sleep(seconds)
        return self.pm.loop.cpu_s / seconds, self.dm.loop.cpu_s / seconds

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()
        if self._shared is not None:
            self._shared.close()
        self.p.close()
        self.d.close()


def _expect(ok: bool, event: object) -> None:
    if not ok:
        raise RuntimeError(f"unexpected event in the overhead bench: {event}")


def _profile_on_loop(rig: Rig, prof: cProfile.Profile, enable: bool) -> None:
    """cProfile the (first) loop thread: with own loops, P's."""

    async def toggle() -> None:
        if enable:
            prof.enable()
        else:
            prof.disable()

    rig.loops[0].run(toggle(), WAIT_S)


def top_entries(prof: cProfile.Profile, limit: int) -> list[dict[str, Any]]:
    """The profile's top functions by own time: {"function", "calls", "tottime_ms", "cumtime_ms"}."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}" if line else path
        rows.append({"function": f"{where}({func})", "calls": calls, "tottime_ms": tottime * 1e3,
                     "cumtime_ms": cumtime * 1e3})  # fmt: skip
    rows.sort(key=lambda r: r["tottime_ms"], reverse=True)
    return rows[:limit]


def measure(case: Case, spec: KVSpec, warmup: int, profile: bool, idle_s: float = IDLE_S) -> dict[str, Any]:
    rig = Rig(
        case.backend,
        spec,
        num_blocks=max(case.concurrency, 1),
        own_loops=case.own_loops,
        wait_event=case.wait_event,
    )
    prof = cProfile.Profile(time.thread_time) if profile else None
    try:
        for w in range(max(1, warmup)):
            rig.batch([f"warm{w}-{i}" for i in range(case.concurrency)])
        idle = rig.idle_rates(idle_s)
        rig.reset()
        if prof is not None:
            _profile_on_loop(rig, prof, True)
        loop0, wall0 = rig.loop_thread_cpu(), time.perf_counter()
        done = 0
        for b in itertools.count():
            n = min(case.concurrency, case.requests - done)
            if n <= 0:
                break
            rig.batch([f"r{b}-{i}" for i in range(n)])
            done += n
        wall = time.perf_counter() - wall0
        loop_cpu = rig.loop_thread_cpu() - loop0
        if prof is not None:
            _profile_on_loop(rig, prof, False)
    finally:
        rig.close()
    us = 1e6 / case.requests
    out: dict[str, Any] = {
        "case": case.name,
        "backend": case.backend,
        "concurrency": case.concurrency,
        "requests": case.requests,
        "loops": "own" if len(rig.loops) > 1 else "shared",
        "wait": "event" if case.wait_event else "poll",
        "descriptors_per_request": spec.num_layers * len(spec.kinds),
    }
    for (side, m), idle_rate in zip((("p", rig.pm), ("d", rig.dm)), idle, strict=True):
        out[f"{side}_loop_us"] = m.loop.cpu_s * us
        out[f"{side}_call_us"] = m.call.cpu_s * us
        out[f"{side}_transfer_us"] = m.transfer.cpu_s * us
        out[f"{side}_message_us"] = m.message.cpu_s * us
        out[f"{side}_us"] = (m.loop.cpu_s + m.call.cpu_s - m.transfer.cpu_s) * us
        out[f"{side}_ratio_vs_goal"] = out[f"{side}_us"] / GOAL_US
        # What an idle connector's polling would have burnt over the same wall time: the rest is the
        # requests' own cost.
        out[f"{side}_idle_cpu_pct"] = idle_rate * 100
        out[f"{side}_net_us"] = out[f"{side}_us"] - idle_rate * wall * us
    out["loop_thread_us"] = loop_cpu * us
    out["wall_us"] = wall * us
    out["goal_us"] = GOAL_US
    if prof is not None:
        out["profile_top"] = top_entries(prof, 15)
    return out


def cases(args: argparse.Namespace) -> list[Case]:
    backends = ["inproc", "nixl"] if args.backend == "all" else [args.backend]
    requests = min(args.requests, 64) if args.quick else args.requests
    concurrency = (1, 8) if args.quick else tuple(args.concurrency)
    loops = {"own": (True,), "shared": (False,), "both": (False, True)}[args.loops]
    return [
        Case(b, c, max(requests, c), own, args.wait == "event")
        for b in backends
        for own in (loops if b == "nixl" else (False,))
        for c in concurrency
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("inproc", "nixl", "all"), default="all")
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per case")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="requests per batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first (handshakes)")
    parser.add_argument("--layers", type=int, default=32, help="layers (regions = 2 x layers)")
    parser.add_argument(
        "--loops",
        choices=("own", "shared", "both"),
        default="own",
        help="NIXL: each connector on its own loop thread as in an engine (default), or both on one",
    )
    parser.add_argument(
        "--wait",
        choices=("event", "poll"),
        default="event",
        help="the bench waits for a batch's end woken by the connectors' on_event, as an engine does "
        "(default), or polling both sides every 200 us (figures before this option)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the loop thread (P's, with own loops); print the top"
    )
    parser.add_argument("--quick", action="store_true", help="few requests and layers, for smoke tests")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar plot")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_MODULES", "^ib*")
    layers = min(args.layers, 4) if args.quick else args.layers
    # One block of 16 tokens x 1 head x 8 dims of float16: 256 bytes per region.
    spec = KVSpec(num_layers=layers, kv_heads=1, head_dim=8, block_size=16)
    idle_s = 0.1 if args.quick else IDLE_S
    results = [measure(c, spec, args.warmup, args.profile, idle_s) for c in cases(args)]
    columns = ("case", "requests", "descs", "P us", "D us", "P net", "D net", "P xfer", "P notif",
               "D notif", "idle P/D %", "wall us")  # fmt: skip
    rows = [
        (r["case"], r["requests"], r["descriptors_per_request"], r["p_us"], r["d_us"], r["p_net_us"],
         r["d_net_us"], r["p_transfer_us"], r["p_message_us"], r["d_message_us"],
         f"{r['p_idle_cpu_pct']:.1f}/{r['d_idle_cpu_pct']:.1f}", r["wall_us"])
        for r in results
    ]  # fmt: skip
    print_table(f"control-plane CPU per request (goal <= {GOAL_US:.0f} us per side)", columns, rows)
    for r in results:
        if "profile_top" in r:
            print_table(
                f"{r['case']}: top of the loop thread's CPU profile ({r['requests']} requests)",
                ("function", "calls", "own ms", "cumulative ms"),
                [(e["function"], e["calls"], e["tottime_ms"], e["cumtime_ms"]) for e in r["profile_top"]],
            )
    if args.json:
        write_json(args.json, envelope("overhead", results))
    if args.plot:
        series = {
            "P": [r["p_us"] for r in results],
            "D": [r["d_us"] for r in results],
            f"goal ({GOAL_US:.0f} us)": [GOAL_US for _ in results],
        }
        bar_plot(args.plot, "control-plane CPU per request", [r["case"] for r in results], series, "us")
    return 0
