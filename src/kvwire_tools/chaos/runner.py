"""``kvwire chaos``: requests through P, D and the router while P or D is SIGKILLed and restarted.

Threads: ``concurrency`` workers send the requests; one "monkey" kills a peer at each planned moment,
restarts it on the same ports and reopens the gate once the router serves again. While a peer is down only
one worker (the prober) keeps sending, so the run measures how fast the router answers 502/503 without
spending all its requests on them. Until every planned kill is made, the workers start at most
``concurrency`` requests past the next kill's moment, and leave one unsent per kill to come: a fast run
cannot end before its kills (a CI run did, and never killed D).
Every wait is bounded by the run's deadline.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from kvwire.engine.config import EngineConfig, preset
from kvwire.engine.engine import Engine
from kvwire.errors import KvwireError
from kvwire.testing.procs import Server, ServerGroup, free_port, server_env
from kvwire_tools.chaos import report
from kvwire_tools.chaos.outcome import Final, RequestRecord, judge, send
from kvwire_tools.chaos.plan import ChaosConfig, PlannedKill, Victim, plan_kills
from kvwire_tools.demo.workload import make_prompts

_ROUTER_HEALTH_INTERVAL_S = 0.5
_POLL_S = 0.05
_QUIET_POLL_S = 0.25
_STATUS_EVERY_S = 10.0
_JOIN_SLACK_S = 10.0


@dataclass
class Cluster:
    prefill: Server
    decode: Server
    router: Server

    def victim(self, v: Victim) -> Server:
        return self.prefill if v is Victim.PREFILL else self.decode


def _engine_args(cfg: ChaosConfig, role: str, port: int) -> list[str]:
    args = [
        "serve", role, "--host", "127.0.0.1", "--port", str(port), "--preset", cfg.preset,
        "--seed", str(cfg.seed), "--backend", cfg.backend, "--mode", "push",
        "--side-channel-port", str(free_port()),
    ]  # fmt: skip
    if role == "prefill":
        args += ["--kv-lease-s", str(cfg.kv_lease_s)]
    return args


def start_cluster(cfg: ChaosConfig, group: ServerGroup) -> Cluster:
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    prefill = group.start("prefill", _engine_args(cfg, "prefill", p_port), p_port)
    decode = group.start("decode", _engine_args(cfg, "decode", d_port), d_port)
    group.wait_healthy([prefill, decode], cfg.startup_timeout_s)
    # The router answers just before the client gives up, so a slow request ends as the router's 504.
    router_timeout = max(1.0, cfg.request_timeout_s - 2.0)
    router_args = [
        "serve", "router", "--port", str(r_port), "--prefill", prefill.url, "--decode", decode.url,
        "--request-timeout", str(router_timeout), "--health-interval", str(_ROUTER_HEALTH_INTERVAL_S),
    ]  # fmt: skip
    router = group.start("router", router_args, r_port)
    group.wait_healthy([router], cfg.startup_timeout_s)
    return Cluster(prefill, decode, router)


def reference_answers(cfg: ChaosConfig, prompts: list[str]) -> list[list[int]]:
    """The colocated engine's answers, computed in this process (same preset and weights seed)."""
    engine = Engine(EngineConfig(preset(cfg.preset), seed=cfg.seed))
    return engine.generate([engine.tokenizer.encode(p) for p in prompts], cfg.max_tokens)


class ChaosRun:
    """The shared state of the workers and the monkey."""

    def __init__(
        self,
        cfg: ChaosConfig,
        cluster: Cluster,
        group: ServerGroup,
        prompts: list[str],
        references: list[list[int]],
        model: str,
    ) -> None:
        self.cfg, self.cluster, self.group = cfg, cluster, group
        self.prompts, self.references, self.model = prompts, references, model
        rng = random.Random(cfg.seed + 2)
        self.records = [RequestRecord(i, rng.randrange(len(prompts))) for i in range(cfg.requests)]
        self.kills: list[report.KillEvent] = []
        self.t0 = time.monotonic()
        # No request starts after this: it must still end (request timeout) before the quiet wait.
        self.last_start = self.t0 + cfg.deadline - cfg.quiet_timeout_s - cfg.request_timeout_s
        self._lock = threading.Lock()
        self._next_index = 0
        self._hold_at: int | None = None  # no request index at or past it starts until the next kill
        self.done = 0
        self.up = threading.Event()
        self.up.set()
        self._probe = threading.Lock()
        self.finished = threading.Event()  # every worker has returned
        limits = httpx.Limits(max_connections=cfg.concurrency + 4)
        self.client = httpx.Client(limits=limits)

    # -- workers -------------------------------------------------------------------------------------------
    def hold_for(self, kills: Sequence[PlannedKill]) -> None:
        """Until ``kills[0]`` is made, let at most ``concurrency`` requests start past its moment (or past
        the current index, if later), leaving one unsent per kill still to come; none lifts the hold."""
        with self._lock:
            if not kills:
                self._hold_at = None
                return
            moment = kills[0].after_started
            bound = max(moment, self._next_index) + self.cfg.concurrency
            self._hold_at = max(moment, min(bound, len(self.records) - len(kills)))

    def hold_while_down(self, kills_left: int) -> None:
        """A peer is down: the gate holds all but the prober, who may send all but one request per kill
        still to come (a long restart must not spend them)."""
        with self._lock:
            self._hold_at = len(self.records) - kills_left

    def _take(self) -> tuple[int, bool] | None:
        """The next request's index and whether this worker is the prober; None: no request is left.
        The gate comes first, so a worker waiting out a restart holds no index (the hold counts indices)."""
        while True:
            prober = self._gate()
            with self._lock:
                over = self._next_index >= len(self.records) or time.monotonic() > self.last_start
                if not over and (self._hold_at is None or self._next_index < self._hold_at):
                    self._next_index += 1
                    return self._next_index - 1, prober
            if prober:
                self._probe.release()
            if over:
                return None
            time.sleep(_POLL_S / 5)  # held for the next kill: the monkey lifts it (bounded: last_start)

    def _gate(self) -> bool:
        """Wait while a peer is down, unless this worker becomes the prober (returns True then)."""
        while not self.up.is_set() and time.monotonic() < self.last_start:
            if self._probe.acquire(blocking=False):
                return True
            self.up.wait(_POLL_S * 2)
        return False

    def worker(self) -> None:
        url = self.cluster.router.url
        while (taken := self._take()) is not None:
            i, prober = taken
            rec = self.records[i]
            try:
                rec.start = time.monotonic()
                rec.final, rec.detail, rec.token_ids = send(
                    self.client, url, self.model, self.prompts[rec.prompt_id], self.cfg.max_tokens,
                    self.cfg.request_timeout_s,
                )  # fmt: skip
                rec.end = time.monotonic()
                judge(rec, self.references[rec.prompt_id])
                with self._lock:
                    self.done += 1
                if prober:
                    self.up.wait(self.cfg.probe_interval_s)
            finally:
                if prober:
                    self._probe.release()

    # -- the monkey ----------------------------------------------------------------------------------------
    def monkey(self, plan: list[PlannedKill], console: Console) -> None:
        """Make each planned kill in turn; the caller armed the first one's hold (``hold_for``)."""
        try:
            for i, kill in enumerate(plan):
                if not self._wait_progress(kill.after_started):
                    return
                time.sleep(kill.jitter_s)
                if self.finished.is_set():
                    return
                self._kill_and_restart(kill, plan[i + 1 :], console)
                event = self.kills[-1]
                if event.error is not None or event.back_at is None:
                    return
                self._wait_recovered(event.back_at)
        finally:
            self.hold_for([])

    def _wait_progress(self, after_started: int) -> bool:
        while self._next_index < after_started:
            if self.finished.is_set() or time.monotonic() > self.last_start:
                return False
            time.sleep(_POLL_S)
        return True

    def _wait_recovered(self, back_at: float) -> None:
        """Before the next kill, let one request sent after the restart succeed (or fail: bounded), so
        every restart shows whether the router recovered."""
        until = min(time.monotonic() + self.cfg.request_timeout_s, self.last_start)
        while time.monotonic() < until and not self.finished.is_set():
            if any(r.final is Final.OK and r.start >= back_at and r.end > 0 for r in self.records):
                return
            time.sleep(_POLL_S)

    def _kill_and_restart(self, kill: PlannedKill, after: Sequence[PlannedKill], console: Console) -> None:
        server = self.cluster.victim(kill.victim)
        self.up.clear()
        event = report.KillEvent(kill.victim.value, time.monotonic())
        self.group.kill(server)
        self.kills.append(event)
        self.hold_while_down(len(after))
        try:
            time.sleep(kill.down_s)
            event.restarted_at = time.monotonic()
            self.group.restart(server)
            left = self.t0 + self.cfg.deadline - time.monotonic()
            self.group.wait_healthy([server], max(1.0, min(self.cfg.startup_timeout_s, left)))
            self._wait_router_healthy(left)
            event.back_at = time.monotonic()
            console.print(
                f"killed {kill.victim.value} at {event.killed_at - self.t0:.1f} s "
                f"({self.done} requests done); serving again after {event.down_s:.1f} s"
            )
        except (KvwireError, OSError) as exc:
            event.error = f"restart failed: {exc}"
            console.print(f"[red]{kill.victim.value} did not come back:[/red] {exc}")
        finally:
            # Armed before the gate opens: the requests after the restart (``concurrency`` of them, the
            # recovery check's) start, and the run cannot end before the next kill.
            self.hold_for(after)
            self.up.set()

    def _wait_router_healthy(self, timeout_s: float) -> None:
        """The router has seen the engine come back (it polls every 0.5 s, or on the next request)."""
        deadline = time.monotonic() + max(1.0, timeout_s)
        while time.monotonic() < deadline:
            try:
                if self.client.get(self.cluster.router.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(_POLL_S)
        raise KvwireError(f"the router did not see every engine healthy within {timeout_s:.0f} s")

    # -- the quiet end -------------------------------------------------------------------------------------
    def wait_quiet(self) -> dict[str, dict[str, Any] | None]:
        """Each engine's block accounting once no request is live and every block is free, or at the bound."""
        urls = {"prefill": self.cluster.prefill.url, "decode": self.cluster.decode.url}
        deadline = min(time.monotonic() + self.cfg.quiet_timeout_s, self.t0 + self.cfg.deadline)
        while True:
            accounts = {side: self._accounting(url) for side, url in urls.items()}
            if all(_quiet(a) for a in accounts.values()) or time.monotonic() > deadline:
                return accounts
            time.sleep(_QUIET_POLL_S)

    def _accounting(self, url: str) -> dict[str, Any] | None:
        try:
            resp = self.client.get(url + "/v1/kv_stats", timeout=5.0)
            acc = resp.json().get("accounting") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return acc if isinstance(acc, dict) else None


def _quiet(acc: dict[str, Any] | None) -> bool:
    return (
        acc is not None and acc["requests"]["live"] == 0 and acc["blocks"]["free"] == acc["blocks"]["total"]
    )


def leaked_blocks(accounts: dict[str, dict[str, Any] | None]) -> dict[str, int | None]:
    """Blocks not free once quiet (None: the engine did not answer)."""
    return {
        side: (int(a["blocks"]["total"]) - int(a["blocks"]["free"]) if a is not None else None)
        for side, a in accounts.items()
    }


def run_chaos(cfg: ChaosConfig, console: Console) -> int:
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="kvwire-chaos-"))
    env = server_env()
    status = 1
    with ServerGroup(log_dir, env) as group:
        try:
            status = _run(cfg, console, group, log_dir)
        except KvwireError as exc:
            console.print(f"[red]chaos failed:[/red] {exc}")
        finally:
            group.stop_all()
    if status != 0:
        console.print(f"server logs: {log_dir}")
    elif cfg.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return status


def _run(cfg: ChaosConfig, console: Console, group: ServerGroup, log_dir: Path) -> int:
    prompts = make_prompts(
        min(cfg.distinct_prompts, cfg.requests), cfg.min_prompt_tokens, cfg.max_prompt_tokens, cfg.seed
    )
    console.print(f"computing {len(prompts)} reference answers in-process (colocated engine)")
    references = reference_answers(cfg, prompts)
    plan = plan_kills(cfg)
    console.print(
        f"starting prefill, decode and the router ({cfg.backend}); {cfg.requests} requests, "
        f"concurrency {cfg.concurrency}, {len(plan)} kills (seed {cfg.seed}); logs in {log_dir}"
    )
    cluster = start_cluster(cfg, group)
    model = str(httpx.get(cluster.prefill.url + "/health", timeout=5.0).json().get("model") or "kvwire")
    run = ChaosRun(cfg, cluster, group, prompts, references, model)
    try:
        _drive(run, plan, console)
        quiet_from = time.monotonic()
        accounts = run.wait_quiet()
        console.print(f"waited {time.monotonic() - quiet_from:.1f} s for the engines to be quiet")
    finally:
        run.client.close()
    return _finish(cfg, console, run, accounts)


def _drive(run: ChaosRun, plan: list[PlannedKill], console: Console) -> None:
    cfg = run.cfg
    workers = [
        threading.Thread(target=run.worker, name=f"chaos-worker-{i}", daemon=True)
        for i in range(cfg.concurrency)
    ]
    monkey = threading.Thread(target=run.monkey, args=(plan, console), name="chaos-monkey", daemon=True)
    run.hold_for(plan)
    for t in (*workers, monkey):
        t.start()
    bound = run.last_start + cfg.request_timeout_s + _JOIN_SLACK_S
    last_status = time.monotonic()
    for t in workers:
        while t.is_alive() and time.monotonic() < bound:
            t.join(_POLL_S * 10)
            if time.monotonic() - last_status > _STATUS_EVERY_S:
                last_status = time.monotonic()
                ok = sum(1 for r in run.records if r.final is Final.OK)
                console.print(f"  {run.done}/{cfg.requests} requests done, {ok} ok")
    run.finished.set()
    # The monkey may be restarting a peer: let it finish (its waits are bounded by the deadline).
    monkey.join(max(0.0, run.t0 + cfg.deadline - time.monotonic()))
    if monkey.is_alive() or any(t.is_alive() for t in workers):
        raise KvwireError("chaos threads still running at the deadline")


def _finish(
    cfg: ChaosConfig, console: Console, run: ChaosRun, accounts: dict[str, dict[str, Any] | None]
) -> int:
    leaked = leaked_blocks(accounts)
    data = report.summary(run.records, run.kills, leaked)
    report.print_report(console, run.records, run.kills, accounts, data)
    if cfg.json_path is not None:
        report.write_json(cfg.json_path, data)
        console.print(f"wrote {cfg.json_path}")
    problems = report.problems(run.records, run.kills, leaked, run.references)
    for line in problems:
        console.print(f"[red]error:[/red] {line}")
    return 1 if problems else 0
