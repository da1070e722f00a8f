"""``kvwire bench flood``: a hostile NIXL peer floods P with notifications while real requests run
(issue 11, item 3: 20,000 ``push_reg``s for unknown transfers became live state on P, its RSS grew
181 -> 329 MB and real requests went from 53 ms to 1.2 s p50; heartbeats naming 500,000 unknown ids were
counted nowhere).

The bench starts, on 127.0.0.1, a prefill engine P, a decode engine D (the reference numpy engine, ``tiny``
preset, NIXL, push mode) and the router, as ``kvwire demo`` does, then per mode runs three phases, each
bounded in count and time:

1. **baseline**: ``--requests`` real requests through the router, one at a time (short prompts,
   ``--max-tokens`` tokens, greedy), timed at the client; P's RSS (``/proc/PID/status`` ``VmRSS``).
2. **during**: a rogue NIXL agent in this process, named like a D life (``make_agent_name`` of an engine
   id and incarnation of its own), loads P's connection-only metadata and sends ``--push-regs``
   ``push_reg``s for transfers P never saw, each naming a listener this bench owns (every connection it
   receives is counted: P dialling it is P acting on the rogue's word), and heartbeats naming
   ``--heartbeat-ids`` unknown transfer ids in ``--heartbeat-msgs`` messages, spread among them. Real
   requests keep running meanwhile, until P has counted the whole flood and at least ``--requests // 2``
   are done (``--phase-timeout`` at most); P's RSS is sampled every 20 ms (the peak is reported).
3. **after**: once P has ended every registration the flood made it hold (they wait for their fence:
   ``kvwire_failures{reason="fence_expired"}``; ``--settle-timeout`` at most; the wait is reported as
   ``settle_s``), ``--requests`` real requests again, P's RSS.

P's ``kvwire_dropped_notifications{reason}`` and ``kvwire_failures{reason}`` are read from ``/metrics``
before the flood and at the end: the differences are the flood's drops, and the registrations P took and
ended, by reason. Every real answer is checked token for token against the reference engine computed in
this process (same preset and seed): a request that failed (an error or a timeout) is counted ``failed``,
one with other tokens ``wrong``; the exit status is 1 only for a wrong answer.

Two modes (``--modes``):

* ``open``: no ``KVWIRE_SECRET``. The rogue gets P's metadata as anyone can: a notif-only ``get_metadata``
  on P's side channel. P bounds the flood: at most ``max_early_registrations`` push_regs for transfers it
  has not prefilled are held (``--p-max-early-registrations``, P's default 4096), the rest are dropped as
  ``overload``; heartbeat ids P does not hold are counted (``heartbeat_unknown_ids``) and never stored.
* ``secret``: ``KVWIRE_SECRET`` set on P, D and the router. An outsider cannot read P's metadata (the side
  channel refuses unsigned requests and seals its replies: the bench records what an unsigned fetch gets),
  so the bench hands the rogue P's metadata **out of band**, fetched with the secret, as a worst case (a
  leaked metadata blob). Every notification the rogue sends is unsealed and is dropped as
  ``unauthenticated`` before it is decoded.

Ratios (during/after vs baseline) compare phases of the same run, against the same servers.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvwire.testing.procs import Server, ServerGroup, free_port, kvwire_command, server_env
from kvwire_tools.bench.common import counter_deltas, envelope, write_json
from kvwire_tools.bench.flood_report import plot, print_results
from kvwire_tools.bench.flood_rogue import (
    PRESET,
    SEED,
    Listener,
    Rogue,
    RssSampler,
    Sent,
    dropped_by_reason,
    failures_by_reason,
    fetch_p_metadata,
    hwm_mb,
    outsider_fetch,
    rss_mb,
)
from kvwire_tools.demo.report import percentile
from kvwire_tools.demo.workload import make_prompt

MODES = ("open", "secret")
PHASES = ("baseline", "during", "after")
# The bench's own cluster secret (secret mode): its servers live only as long as the run, on loopback.
BENCH_SECRET = "kvwire-bench-flood"
PROMPTS = (
    "Hello over NIXL",
    "the quick brown fox jumps over a lazy dog",
    "kv caches move from prefill to decode",
    "a short prompt",
    "every token matches the colocated reference",
    "push mode: decode registers blocks, prefill writes them",
)

_SCRAPE_PERIOD_S = 0.25
_STILL_S = 3.0  # P's drop counts unchanged this long: it has taken all of the flood that arrived


def prompts(tokens: int) -> tuple[str, ...]:
    """The real requests' prompts: ``PROMPTS``, or (``tokens`` > 0) as many prompts of ``tokens`` tokens."""
    if tokens <= 0:
        return PROMPTS
    rng = random.Random(SEED)
    return tuple(make_prompt(tokens, rng) for _ in PROMPTS)


# -- real requests -------------------------------------------------------------------------------------------
def reference_answers(prompts: Sequence[str], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy answer from the reference engine in this process (same preset and seed)."""
    from kvwire.engine.config import EngineConfig, preset
    from kvwire.engine.engine import Engine

    model = preset(PRESET)
    longest = max(len(p) for p in prompts) + 1 + max_tokens  # tokens: bytes, BOS, the answer
    num_blocks = max(64, -(-longest // model.block_size) + 1)
    ref = Engine(EngineConfig(model, num_blocks=num_blocks, seed=SEED))
    return {p: list(ref.generate([ref.tokenizer.encode(p)], max_tokens, ignore_eos=True)[0]) for p in prompts}


@dataclass(frozen=True, slots=True)
class Sample:
    latency_s: float
    ok: bool  # HTTP 200 with tokens
    correct: bool  # the reference's tokens
    error: str = ""  # why it failed: "HTTP <status>" or the exception's type


class Requests:
    """Real requests through the router, one at a time, each checked against the reference."""

    def __init__(
        self,
        client: httpx.Client,
        url: str,
        model: str,
        refs: Mapping[str, list[int]],
        max_tokens: int,
        timeout_s: float,
    ) -> None:
        self.client, self.url, self.model = client, url, model
        self.refs, self.prompts = refs, list(refs)
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self._k = 0

    def one(self) -> Sample:
        prompt = self.prompts[self._k % len(self.prompts)]
        self._k += 1
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        t0 = time.perf_counter()
        try:
            resp = self.client.post(self.url + "/v1/completions", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return Sample(time.perf_counter() - t0, False, False, type(exc).__name__)
        latency = time.perf_counter() - t0
        if resp.status_code != 200:
            return Sample(latency, False, False, f"HTTP {resp.status_code}")
        ids = resp.json()["choices"][0].get("token_ids") or []
        return Sample(latency, bool(ids), ids == self.refs[prompt])

    def with_client(self, client: httpx.Client) -> Requests:
        return Requests(client, self.url, self.model, self.refs, self.max_tokens, self.timeout_s)

    def run(self, n: int) -> list[Sample]:
        return [self.one() for _ in range(n)]

    def run_until(self, stop: threading.Event, at_least: int, deadline: float) -> list[Sample]:
        """Requests until ``stop`` is set and ``at_least`` are done, or ``deadline`` (monotonic) passes."""
        out: list[Sample] = []
        while time.monotonic() < deadline and (not stop.is_set() or len(out) < at_least):
            out.append(self.one())
        return out


def phase_figures(samples: Sequence[Sample]) -> dict[str, Any]:
    lat = [s.latency_s for s in samples]

    def ms(q: float) -> float | None:
        v = percentile(lat, q)
        return None if v is None else v * 1e3

    return {
        "requests": len(samples),
        "failed": sum(not s.ok for s in samples),
        "errors": dict(collections.Counter(s.error for s in samples if s.error)),
        "wrong": sum(s.ok and not s.correct for s in samples),
        "p50_ms": ms(50),
        "p99_ms": ms(99),
        "latencies_ms": [round(v * 1e3, 2) for v in lat],  # in the order sent
    }


# -- servers -------------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    p: Server
    d: Server
    router: Server
    side_channel_port: int


def start_cluster(group: ServerGroup, secret: str | None, args: argparse.Namespace) -> Cluster:
    env = {"KVWIRE_SECRET": secret} if secret else {}
    base = ["--host", "127.0.0.1", "--preset", PRESET, "--seed", str(SEED), "--mode", "push"]
    p_port, d_port, sc_port = free_port(), free_port(), free_port()
    p_args = ["serve", "prefill", "--port", str(p_port), "--side-channel-port", str(sc_port), *base]
    if args.p_max_early_registrations:
        p_args += ["--max-early-registrations", str(args.p_max_early_registrations)]
    if args.p_fence_ms:
        p_args += ["--fence-ms", str(args.p_fence_ms)]
    d_args = ["serve", "decode", "--port", str(d_port), "--side-channel-port", str(free_port()), *base]
    p = group.start_argv("prefill", kvwire_command(*p_args), p_port, env)
    d = group.start_argv("decode", kvwire_command(*d_args), d_port, env)
    group.wait_healthy([p, d], args.startup_timeout)
    r_port = free_port()
    r_args = [
        "serve",
        "router",
        "--port",
        str(r_port),
        "--mode",
        "push",
        "--prefill",
        p.url,
        "--decode",
        d.url,
    ]
    router = group.start_argv("router", kvwire_command(*r_args), r_port, env)
    group.wait_healthy([router], args.startup_timeout)
    return Cluster(p, d, router, sc_port)


def _pid(server: Server) -> int:
    if server.proc is None:
        raise RuntimeError(f"{server.name} is not running")
    return server.proc.pid


# -- one mode ------------------------------------------------------------------------------------------------
@dataclass
class ModeResult:
    mode: str
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    sent: Sent = field(default_factory=Sent)
    listener_connections: int = 0
    metadata_source: str = ""
    outsider_fetch: str = ""
    drain_s: float = 0.0
    drained: bool = False  # P counted the whole flood (the expected drops) before the phase ended
    settle_s: float = 0.0  # from the flood phase's end until P had ended every registration it took
    settled: bool = False
    drops_before: dict[str, float] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # P's kvwire_failures{reason} over flood + after
    failures_before: dict[str, float] = field(default_factory=dict)


def _wait_counted(
    client: httpx.Client,
    p_url: str,
    counter: Callable[[str], dict[str, float]],
    before: Mapping[str, float],
    expect: Mapping[str, int],
    timeout_s: float,
    pump: Callable[[], None],
    still_s: float | None = None,
) -> tuple[float, bool]:
    """Wait until P's ``counter`` (parsed from ``/metrics``) grew by ``expect`` (each reason at least its
    figure), calling ``pump`` (the rogue's progress: UCX completes a large notification's send only on the
    sender's progress) every few ms; give up after ``timeout_s``, or once the counts stood still for
    ``still_s`` (when given). Returns (seconds waited, whether ``expect`` was reached)."""
    t0 = time.monotonic()
    last: dict[str, int] | None = None
    still_since = next_scrape = t0
    while (now := time.monotonic()) - t0 < timeout_s:
        pump()
        if now >= next_scrape:
            next_scrape = now + _SCRAPE_PERIOD_S
            got = counter_deltas(before, counter(client.get(p_url + "/metrics").text))
            if all(got.get(r, 0) >= n for r, n in expect.items()):
                return time.monotonic() - t0, True
            if got != last:
                last, still_since = got, now
            elif still_s is not None and now - still_since >= still_s:
                break
        time.sleep(0.005)
    return time.monotonic() - t0, False


@dataclass
class Mode:
    """One mode's servers, client, real requests and rogue, and what was measured."""

    out: ModeResult
    args: argparse.Namespace
    client: httpx.Client
    cluster: Cluster
    reqs: Requests
    rogue: Rogue

    def metrics(self) -> str:
        return self.client.get(self.cluster.p.url + "/metrics").text

    def transfers(self) -> int:
        return int(self.client.get(self.cluster.p.url + "/v1/kv_stats").json().get("transfers", 0))

    def timed(self, phase: str, run: Callable[[], dict[str, Any]]) -> None:
        """Run one phase; its figures, with P's RSS (unless the phase set its peak) and P's transfers."""
        before = self.transfers()
        figures = run()
        figures.setdefault("rss_mb", rss_mb(_pid(self.cluster.p)))
        figures["p_transfers"] = self.transfers() - before
        self.out.phases[phase] = figures

    def flood(self) -> dict[str, Any]:
        """The flood, with real requests running beside it in a thread until P has taken all of it and at
        least half of ``--requests`` are done (or ``--phase-timeout``); P's RSS sampled meanwhile."""
        out, args = self.out, self.args
        text = self.metrics()
        out.drops_before, out.failures_before = dropped_by_reason(text), failures_by_reason(text)
        stop = threading.Event()
        during: list[Sample] = []
        deadline = time.monotonic() + args.phase_timeout

        def drive() -> None:
            # Its own HTTP client: this thread's requests and the main thread's scrapes share nothing.
            with httpx.Client(timeout=args.request_timeout) as own:
                during.extend(
                    self.reqs.with_client(own).run_until(stop, max(1, args.requests // 2), deadline)
                )

        worker = threading.Thread(target=drive, name="flood-requests", daemon=True)
        with RssSampler(_pid(self.cluster.p)) as rss:
            worker.start()
            out.sent = self.rogue.flood(args.push_regs, args.heartbeat_ids, args.heartbeat_msgs, args.rate)
            expect = (
                {"unauthenticated": out.sent.push_regs + out.sent.heartbeats}
                if out.mode == "secret"
                else {"heartbeat_unknown_ids": out.sent.heartbeat_ids}
            )
            left = max(1.0, deadline - time.monotonic())
            out.drain_s, out.drained = _wait_counted(
                self.client, self.cluster.p.url, dropped_by_reason, out.drops_before, expect, left,
                self.rogue.agent.progress, still_s=_STILL_S,
            )  # fmt: skip
            stop.set()
            worker.join(timeout=args.request_timeout + 5.0)
        figures = phase_figures(during)
        figures["rss_mb"] = rss.peak
        return figures

    def settle(self) -> None:
        """Wait until P ended every registration the flood made (they hold P's early-registration slots
        until their fence expires: counted in ``kvwire_failures``), at most ``--settle-timeout``."""
        out = self.out
        dropped = counter_deltas(out.drops_before, dropped_by_reason(self.metrics()))
        # The push_regs P took (real push_regs dropped as overload meanwhile make this a little low).
        held = max(0, out.sent.push_regs - dropped.get("overload", 0) - dropped.get("unauthenticated", 0))
        before = {"all": sum(out.failures_before.values())}
        out.settle_s, out.settled = _wait_counted(
            self.client, self.cluster.p.url, lambda t: {"all": sum(failures_by_reason(t).values())},
            before, {"all": held}, self.args.settle_timeout, self.rogue.agent.progress,
        )  # fmt: skip

    def finish(self) -> None:
        text = self.metrics()
        self.out.drops = counter_deltas(self.out.drops_before, dropped_by_reason(text))
        self.out.failures = counter_deltas(self.out.failures_before, failures_by_reason(text))


def run_mode(mode: str, args: argparse.Namespace, refs: Mapping[str, list[int]], log_dir: Path) -> ModeResult:
    """Start P, D and the router (with ``KVWIRE_SECRET`` in secret mode), run the phases, stop them."""
    secret = BENCH_SECRET if mode == "secret" else None
    out = ModeResult(mode)
    with ServerGroup(log_dir / mode, server_env()) as group:
        cluster = start_cluster(group, secret, args)
        p_pid = _pid(cluster.p)
        with httpx.Client(timeout=args.request_timeout) as client:
            reqs = Requests(client, cluster.router.url, "kvwire", refs, args.max_tokens, args.request_timeout)
            reqs.run(args.warmup)  # handshakes, first allocations, lazy imports: not counted
            before = _transfers(client, cluster.p.url)
            out.phases["baseline"] = phase_figures(reqs.run(args.requests))
            transfers = _transfers(client, cluster.p.url) - before
            out.phases["baseline"].update(rss_mb=rss_mb(p_pid), p_transfers=transfers)
            out.outsider_fetch = outsider_fetch("127.0.0.1", cluster.side_channel_port)
            out.metadata_source = (
                "out of band (fetched by the bench WITH the secret: a worst case)"
                if secret
                else "P's side channel (a notif-only get_metadata, no credentials)"
            )
            p_md = fetch_p_metadata("127.0.0.1", cluster.side_channel_port, secret)
            listener = Listener()
            try:
                rogue = Rogue(p_md, listener.port)
                try:
                    m = Mode(out, args, client, cluster, reqs, rogue)
                    m.timed("during", m.flood)
                    m.settle()
                    m.timed("after", lambda: phase_figures(reqs.run(args.requests)))
                    m.finish()
                finally:
                    rogue.close()
            finally:
                listener.close()
            out.listener_connections = listener.connections
            out.phases["after"]["rss_hwm_mb"] = hwm_mb(p_pid)
        group.check_all_alive()
    return out


def _transfers(client: httpx.Client, url: str) -> int:
    return int(client.get(url + "/v1/kv_stats").json().get("transfers", 0))


# -- the run -------------------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cases(result: ModeResult) -> list[dict[str, Any]]:
    base = result.phases["baseline"]
    cases = []
    for phase in PHASES:
        fig = result.phases[phase]
        case = {"mode": result.mode, "phase": phase, **fig}
        for key in ("p50_ms", "p99_ms", "rss_mb"):
            case[key.rsplit("_", 1)[0] + "_x_baseline"] = _ratio(fig.get(key), base.get(key))
        cases.append(case)
    return cases


def _mode_doc(result: ModeResult) -> dict[str, Any]:
    base, during = result.phases["baseline"], result.phases["during"]
    growth = None if during["rss_mb"] is None else during["rss_mb"] - base["rss_mb"]
    return {
        "drops": result.drops,
        "p_failures": result.failures,
        "listener_connections": result.listener_connections,
        "sent": {"push_regs": result.sent.push_regs, "heartbeats": result.sent.heartbeats,
                 "heartbeat_ids": result.sent.heartbeat_ids, "send_errors": result.sent.errors,
                 "seconds": result.sent.seconds},
        "drain_s": result.drain_s,
        "drained": result.drained,
        "settle_s": result.settle_s,
        "settled": result.settled,
        "rss_growth_mb": growth,
        "rss_hwm_mb": result.phases["after"].get("rss_hwm_mb"),
        "metadata_source": result.metadata_source,  # how the rogue got P's connection metadata
        "outsider_fetch": result.outsider_fetch,
    }  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    refs = reference_answers(prompts(args.prompt_tokens), args.max_tokens)
    keep = args.log_dir is not None
    log_dir = Path(args.log_dir) if keep else Path(tempfile.mkdtemp(prefix="kvwire-bench-flood-"))
    ok = False
    results: list[ModeResult] = []
    try:
        for mode in args.modes:
            results.append(run_mode(mode, args, refs, log_dir))
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not ok:
            print(f"flood: server logs kept in {log_dir}", flush=True)
    doc: dict[str, Any] = envelope("flood", [c for r in results for c in _cases(r)])
    doc["modes"] = {r.mode: _mode_doc(r) for r in results}
    doc["config"] = {
        "requests": args.requests, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens or None,
        "push_regs": args.push_regs,
        "heartbeat_ids": args.heartbeat_ids, "heartbeat_msgs": args.heartbeat_msgs, "rate": args.rate,
        "p_max_early_registrations": args.p_max_early_registrations or "P's default",
        "p_fence_ms": args.p_fence_ms or "P's default",
        "preset": PRESET, "backend": "nixl",
    }  # fmt: skip
    return doc


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated list of {', '.join(MODES)}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--modes", type=_modes, default=",".join(MODES), help="comma-separated: open (no secret), secret")
    add("--requests", type=int, default=30, help="real requests in the baseline and after phases")
    add("--warmup", type=int, default=5, help="requests before the baseline, not counted")
    add("--max-tokens", type=int, default=4, help="tokens per real request")
    add(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompt length of the real requests; 0: short prompts "
        "of 16-57 tokens (P's prefill then often ends before D's push_reg arrives, so a full table of "
        "early registrations hits only some of them; 1500: most)",
    )
    add("--push-regs", type=int, default=20_000, help="push_regs for unknown transfers in the flood")
    add("--heartbeat-ids", type=int, default=500_000, help="unknown transfer ids named by heartbeats")
    add("--heartbeat-msgs", type=int, default=50, help="heartbeat messages carrying them")
    add("--rate", type=float, default=0.0, help="flood messages per second; 0: as fast as possible")
    add(
        "--p-max-early-registrations",
        type=int,
        default=0,
        help="P's --max-early-registrations (0: its default)",
    )
    add(
        "--p-fence-ms",
        type=int,
        default=0,
        help="P's --fence-ms (0: its default): how long P holds a push_reg whose prefill has not finished",
    )
    add(
        "--settle-timeout",
        type=float,
        default=40.0,
        help="after the flood, wait at most this long for P to "
        "end the registrations it took (their fence) before the after phase",
    )
    add("--phase-timeout", type=float, default=60.0, help="the flood phase ends by then at the latest")
    add("--startup-timeout", type=float, default=120.0)
    add("--request-timeout", type=float, default=30.0)
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--plot", metavar="PATH", help="write a PNG plot")
    add(
        "--log-dir",
        metavar="DIR",
        help="keep the servers' logs there (default: a temporary directory, kept only when the bench fails)",
    )


def run(args: argparse.Namespace) -> int:
    doc = measure(args)
    print_results(doc)
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot(args.plot, doc)
    failed = {f"{c['mode']}/{c['phase']}": c["failed"] for c in doc["cases"] if c["failed"]}
    if failed:
        print(f"flood: real requests failed (an error answer or a timeout): {failed}")
    wrong = sum(c["wrong"] for c in doc["cases"])
    if wrong:
        print(f"flood: {wrong} real requests answered tokens other than the reference's")
        return 1
    return 0
