"""``kvwire bench fleet``: a 2P2D fleet of reference engines on one etcd, under load, while engines join,
drain, restart one by one and die; then round robin against prefix-aware routing on a shared-prefix
workload; then the router's pick cost from 2 to 32 engines.

Scenarios, each on the same fleet (``--p`` prefill and ``--d`` decode engines, all found through etcd):

* ``steady``: ``--requests`` requests at ``--concurrency``.
* ``join``: a new prefill engine starts under load; ``join_to_traffic_s`` is from the router listing it
  (it registered: the watch takes milliseconds) to the router sending it its first request.
* ``drain``: that engine gets SIGTERM under load; it marks itself draining, finishes, deregisters, exits 0.
* ``rolling``: every engine in turn gets SIGTERM (drain) and is started again on its port (a new
  incarnation), under load that runs until the last one is back.
* ``kill``: a decode engine gets SIGKILL under load, at a moment the router has requests on it;
  ``in_flight_at_kill`` is how many (read just before, plus those sent to it until just after). Its
  lease then expires (``--ttl``); the engine is started again afterwards.

Every answer is compared with the colocated reference engine's (temperature 0): ``mismatched`` counts the
differences. ``routing`` sends the same shared-prefix requests (few-shot prompts: a long shared prefix and
a short question) through two routers on the same fleet, one per policy; ``prefix_hit_rate`` is the share
of prompt blocks the chosen P already held by the router's index; ``engine_hit_rate`` the share of prompt
tokens the prefill engines found in their prefix caches (``--prefix-cache``, on for every P here; the
colocated reference keeps none). Each policy gets its own prefixes, so the second does not find the
first's in the caches. Goal: prefix-aware TTFT p50 <= 0.7x round robin's.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvwire.testing.etcd import EtcdServer
from kvwire.testing.procs import ServerGroup, server_env
from kvwire_tools.bench.common import envelope, print_table, write_json
from kvwire_tools.bench.fleet_cost import router_cost
from kvwire_tools.bench.fleet_load import (
    FleetProcs,
    FleetSetup,
    Load,
    Outcome,
    log_dir_for,
    plain_prompts,
    reference_answers,
    shared_prefix_prompts,
)

POLICIES = ("round_robin", "prefix_aware")
_MAIN = "round_robin"  # the scenarios' router


def _case(scenario: str, fleet: FleetProcs, outcome: Outcome, **extra: Any) -> dict[str, Any]:
    p = sum(1 for n, s in fleet.engines.items() if n.startswith("prefill") and _alive(s))
    d = sum(1 for n, s in fleet.engines.items() if n.startswith("decode") and _alive(s))
    return {"scenario": scenario, "p": p, "d": d, **outcome.case(), "in_flight_at_kill": 0, **extra}


def _alive(server: Any) -> bool:
    return server.proc is not None and server.proc.poll() is None


class Bench:
    def __init__(self, args: argparse.Namespace, fleet: FleetProcs) -> None:
        self.args = args
        self.fleet = fleet
        self.setup = fleet.setup
        self.prompts = plain_prompts(16, args.seed)
        groups = args.prefix_groups
        per_group = max(1, args.routing_requests // groups)
        # Each policy its own prefixes (same shape, other seed): the second must not find the first's
        # prefixes in the engines' caches.
        self.shared = {
            policy: shared_prefix_prompts(groups, per_group, args.prefix_bytes, args.seed + 1 + i)
            for i, policy in enumerate(POLICIES)
        }
        every = [*self.prompts, *(p for prompts in self.shared.values() for p in prompts)]
        assert fleet.colocated is not None
        self.reference = reference_answers(fleet.colocated, every, self.setup)
        self.router = fleet.routers[_MAIN]

    def load(self, requests: int, prompts: Sequence[str] | None = None, policy: str = _MAIN) -> Load:
        url = self.fleet.routers[policy].url
        return Load(self.setup, url, prompts or self.prompts, self.reference, requests).start()

    def steady(self) -> dict[str, Any]:
        return _case("steady", self.fleet, self.load(self.args.requests).join())

    def open_load(self) -> Load:
        """Load that runs through an action: started, a quarter of ``--requests`` sent, then the action."""
        load = self.load(self.args.requests * 100)  # bounded; stopped by ``finish``
        load.wait_sent(self.args.requests // 4)
        return load

    def finish(self, load: Load) -> Outcome:
        """After the action: half of ``--requests`` more, then stop."""
        load.wait_sent(load.sent + self.args.requests // 2)
        load.stop()
        return load.join()

    def join(self) -> dict[str, Any]:
        load = self.open_load()
        new = self.fleet.start_engine(f"prefill{self.args.p}")
        self.fleet.wait_view(self.router, lambda v: v.get(new.url, {}).get("healthy", False), "new engine")
        took = self.fleet.wait_view(
            self.router, lambda v: v[new.url]["sent"] > 0, "traffic to the new engine", 10.0
        )
        return _case("join", self.fleet, self.finish(load), join_to_traffic_s=round(took, 3))

    def drain(self) -> dict[str, Any]:
        name = max(n for n in self.fleet.engines if n.startswith("prefill"))  # the joined one, if any
        victim = self.fleet.engines[name]
        load = self.open_load()
        start = time.monotonic()
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGTERM)
        status = victim.proc.wait(timeout=60)
        took = time.monotonic() - start
        self.fleet.wait_view(self.router, lambda v: victim.url not in v, "the drained engine gone", 10.0)
        del self.fleet.engines[name]
        return _case("drain", self.fleet, self.finish(load), drain_s=round(took, 3), exit_status=status)

    def rolling(self) -> dict[str, Any]:
        load = self.open_load()
        statuses = []
        for server in list(self.fleet.engines.values()):
            assert server.proc is not None
            old = self.fleet.view(self.router)[server.url]["engine_id"]
            server.proc.send_signal(signal.SIGTERM)
            statuses.append(server.proc.wait(timeout=60))
            self.fleet.group.restart(server)
            self.fleet.wait_view(self.router, _new_life(server.url, old), f"{server.name}'s new life")
        return _case("rolling", self.fleet, self.finish(load), exit_statuses=statuses)

    def kill(self) -> dict[str, Any]:
        victim = self.fleet.engines["decode0"]
        load = self.open_load()
        # Killed while it has requests: what the goal is about (at most 5 s of looking for the moment).
        deadline = time.monotonic() + 5.0
        while (before := self.fleet.view(self.router)[victim.url])["inflight"] == 0:
            if time.monotonic() > deadline:
                break
        self.fleet.group.kill(victim)
        # Requests sent to it between the read and the kill were in flight on it too (the count can only
        # err high by one sent in the milliseconds after the kill: refused, then picked again elsewhere).
        after = self.fleet.view(self.router).get(victim.url, before)
        in_flight = before["inflight"] + after["sent"] - before["sent"]
        del self.fleet.engines["decode0"]
        outcome = self.finish(load)
        gone = self.fleet.wait_view(self.router, lambda v: victim.url not in v, "the lease expiry", 30.0)
        case = _case("kill", self.fleet, outcome, in_flight_at_kill=in_flight, lease_gone_s=round(gone, 3))
        self.fleet.group.restart(victim)  # back for what follows, as a new incarnation
        self.fleet.engines["decode0"] = victim
        self.fleet.wait_view(self.router, lambda v: v.get(victim.url, {}).get("healthy", False), "decode0")
        return case

    def routing(self) -> list[dict[str, Any]]:
        out = []
        for policy in POLICIES:
            router = self.fleet.routers[policy]
            before, engines_before = _prefix_blocks(router.url), self._engine_hits()
            outcome = self.load(self.args.routing_requests, self.shared[policy], policy).join()
            after, engines_after = _prefix_blocks(router.url), self._engine_hits()
            total = after["total"] - before["total"]
            hit_rate = (after["hit"] - before["hit"]) / total if total else 0.0
            queried = engines_after[0] - engines_before[0]
            engine_rate = (engines_after[1] - engines_before[1]) / queried if queried else 0.0
            case = outcome.case()
            out.append({
                "policy": policy, "prefix_hit_rate": round(hit_rate, 3), "ttft_p50_ms": case["ttft_p50_ms"],
                "engine_hit_rate": round(engine_rate, 3), "failed": case["failed"],
                "mismatched": case["mismatched"],
            })  # fmt: skip
        return out

    def _engine_hits(self) -> tuple[int, int]:
        """Prompt tokens the prefill engines looked up in their prefix caches, and found there."""
        queried = hit = 0
        for name, server in self.fleet.engines.items():
            if name.startswith("prefill") and _alive(server):
                load = httpx.get(server.url + "/health", timeout=5.0).json()["load"]
                queried += int(load.get("prefix_query_tokens", 0))
                hit += int(load.get("prefix_hit_tokens", 0))
        return queried, hit


def _new_life(url: str, old_engine_id: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    def ready(view: dict[str, dict[str, Any]]) -> bool:
        entry = view.get(url, {})
        return bool(entry.get("healthy")) and entry.get("engine_id") != old_engine_id

    return ready


def _prefix_blocks(router_url: str) -> dict[str, int]:
    body = httpx.get(router_url + "/health", timeout=5.0).json()
    return {k: int(v) for k, v in body["prefix_blocks"].items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    setup = FleetSetup(
        backend=args.backend, ttl_s=args.ttl, rate=args.rate, max_tokens=args.max_tokens,
        concurrency=args.concurrency, startup_timeout_s=args.startup_timeout,
    )  # fmt: skip
    log_dir = log_dir_for(Path(args.log_dir) if args.log_dir else None)
    print(f"fleet bench: logs in {log_dir}")
    with EtcdServer(log_dir / "etcd") as etcd, ServerGroup(log_dir / "servers", server_env()) as group:
        fleet = FleetProcs(setup, group, etcd)
        fleet.start(args.p, args.d, POLICIES)
        bench = Bench(args, fleet)
        cases = []
        for name in args.scenarios:
            cases.append(getattr(bench, name)())
            print(f"  {name}: {json.dumps(cases[-1])}")
        routing = bench.routing() if args.routing_requests > 0 else []
    doc = envelope("fleet", cases)
    doc["routing"] = routing
    doc["router_cost"] = router_cost((1, 2, 4, 8, 16, 32), args.cost_picks)
    return doc


def goals(doc: Mapping[str, Any]) -> list[str]:
    """The issue's goals this run missed (empty: all met)."""
    missed = []
    for c in doc["cases"]:
        if c["scenario"] == "kill":
            if c["failed"] > c["in_flight_at_kill"] or c["mismatched"]:
                missed.append(f"kill: {c['failed']} failed > {c['in_flight_at_kill']} in flight")
        elif c["failed"] or c["mismatched"]:
            missed.append(f"{c['scenario']}: {c['failed']} failed, {c['mismatched']} mismatched")
        if c["scenario"] == "join" and c["join_to_traffic_s"] > 2.0:
            missed.append(f"join: first traffic after {c['join_to_traffic_s']} s")
    routing = {r["policy"]: r for r in doc["routing"]}
    for r in routing.values():
        if r["failed"] or r["mismatched"]:
            missed.append(f"routing {r['policy']}: {r['failed']} failed, {r['mismatched']} mismatched")
    if len(routing) == 2:
        ratio = routing_ratio(doc)
        if ratio is None or ratio > ROUTING_GOAL:
            missed.append(f"routing: prefix-aware TTFT p50 {ratio}x round robin's (goal <= {ROUTING_GOAL})")
    cost = {c["engines"]: c["pick_us"] for c in doc.get("router_cost", [])}
    if 2 in cost and 32 in cost and cost[32] > COST_GOAL * cost[2]:
        missed.append(f"router cost: {cost[32]} us at 32 engines > {COST_GOAL}x {cost[2]} us at 2")
    return missed


ROUTING_GOAL = 0.7
COST_GOAL = 1.3  # "flat from 2 to 32 engines", with room for this host's noise


def routing_ratio(doc: Mapping[str, Any]) -> float | None:
    """Prefix-aware TTFT p50 over round robin's, same run."""
    by = {r["policy"]: r["ttft_p50_ms"] for r in doc["routing"]}
    rr, pa = by.get("round_robin"), by.get("prefix_aware")
    return round(pa / rr, 3) if rr and pa is not None else None


def print_results(doc: Mapping[str, Any]) -> None:
    cols = (
        "scenario",
        "p",
        "d",
        "requests",
        "ok",
        "failed",
        "mismatched",
        "in flight at kill",
        "TTFT p50",
        "p99",
    )
    keys = ("scenario", "p", "d", "requests", "ok", "failed", "mismatched", "in_flight_at_kill")
    rows: list[list[object]] = [
        [*(c[k] for k in keys), _ms(c["ttft_p50_ms"]), _ms(c["ttft_p99_ms"])] for c in doc["cases"]
    ]
    print_table("fleet scenarios", cols, rows)
    rows = [
        [r["policy"], f"{r['prefix_hit_rate']:.2f}", f"{r['engine_hit_rate']:.2f}", _ms(r["ttft_p50_ms"])]
        for r in doc["routing"]
    ]
    heads = ("policy", "prefix hit rate (router)", "engine hit rate", "TTFT p50")
    print_table("routing (shared-prefix workload)", heads, rows)
    rows = [[c["engines"], f"{c['pick_us']:.1f}"] for c in doc["router_cost"]]
    print_table("router pick cost", ("engines", "us per request"), rows)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


SCENARIOS = ("steady", "join", "drain", "rolling", "kill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--p", type=int, default=2, help="prefill engines")
    add("--d", type=int, default=2, help="decode engines")
    add("--requests", type=int, default=40, help="requests per scenario (rolling runs until it is done)")
    add("--routing-requests", type=int, default=64, help="shared-prefix requests per routing policy; 0: skip")
    add("--prefix-bytes", type=int, default=768, help="length of the shared prefixes")
    add(
        "--prefix-groups",
        type=int,
        default=8,
        help="distinct shared prefixes (more than one P's cache holds)",
    )
    add("--concurrency", type=int, default=3)
    add("--rate", type=float, default=20.0, help="requests per second at most, all clients together")
    add("--max-tokens", type=int, default=8)
    add("--ttl", type=int, default=2, help="the engines' lease TTL (s)")
    add("--backend", default="nixl", choices=("nixl",), help="transfer backend of the engines")
    add("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    add("--cost-picks", type=int, default=2000, help="picks timed per fleet size for router_cost")
    add("--seed", type=int, default=0)
    add("--startup-timeout", type=float, default=120.0)
    add("--log-dir", metavar="DIR", help="server logs (default: a new temporary directory)")
    add("--json", metavar="PATH", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    doc = measure(args)
    print_results(doc)
    if args.json:
        write_json(args.json, doc)
    missed = goals(doc)
    for line in missed:
        print(f"goal missed: {line}")
    return 1 if missed else 0
