"""``kvwire bench fleet``'s processes and load: an etcd, engines that register there, routers that watch
it, a colocated reference engine, and client threads whose answers are checked token by token.

Every engine gets ``--discovery`` and nothing else about the fleet: the routers start with no URL at all.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvwire.engine.config import PRESETS
from kvwire.testing.etcd import EtcdServer
from kvwire.testing.procs import Server, ServerGroup, free_port
from kvwire_tools.demo.report import percentile
from kvwire_tools.demo.workload import RequestFailed, stream_completion

_POLL_S = 0.02


@dataclass(frozen=True)
class FleetSetup:
    preset: str = "tiny"
    seed: int = 0
    backend: str = "nixl"
    num_blocks: int = 256
    ttl_s: int = 2
    max_tokens: int = 8
    concurrency: int = 3
    rate: float = 20.0  # requests per second at most (a steady load, not a flood the 2 cores drown in)
    request_timeout_s: float = 30.0
    startup_timeout_s: float = 120.0

    @property
    def model(self) -> str:
        """The name the engines serve (``serve``: ``kvwire-{preset}``), so any preset is asked for."""
        return f"kvwire-{PRESETS[self.preset].name}"


class FleetProcs:
    """The fleet's processes, by name (``prefill0``, ``decode1``, ``router-prefix_aware``, ...)."""

    def __init__(self, setup: FleetSetup, group: ServerGroup, etcd: EtcdServer) -> None:
        self.setup = setup
        self.group = group
        self.etcd = etcd
        self.engines: dict[str, Server] = {}
        self.routers: dict[str, Server] = {}
        self.colocated: Server | None = None

    def engine_args(self, role: str, port: int) -> list[str]:
        s = self.setup
        args = ["serve", role, "--port", str(port), "--preset", s.preset, "--seed", str(s.seed)]
        args += ["--num-blocks", str(s.num_blocks), "--log-level", "warning"]
        if role != "colocated":
            args += ["--backend", s.backend, "--discovery", self.etcd.url, "--discovery-ttl", str(s.ttl_s)]
        if role == "prefill":
            args.append("--prefix-cache")  # as vLLM's default; the colocated reference keeps none
        return args

    def start_engine(self, name: str) -> Server:
        port = free_port()
        server = self.group.start(name, self.engine_args(name.rstrip("0123456789"), port), port)
        self.engines[name] = server
        return server

    def start_router(self, policy: str) -> Server:
        port = free_port()
        args = ["serve", "router", "--port", str(port), "--discovery", self.etcd.url, "--policy", policy]
        args += ["--request-timeout", str(self.setup.request_timeout_s), "--log-level", "warning"]
        server = self.group.start(f"router-{policy}", args, port)
        self.routers[policy] = server
        return server

    def start(self, p: int, d: int, policies: Sequence[str]) -> None:
        port = free_port()
        self.colocated = self.group.start("colocated", self.engine_args("colocated", port), port)
        for i in range(p):
            self.start_engine(f"prefill{i}")
        for i in range(d):
            self.start_engine(f"decode{i}")
        for policy in policies:
            self.start_router(policy)
        every = [self.colocated, *self.engines.values(), *self.routers.values()]
        self.group.wait_healthy(every, self.setup.startup_timeout_s)
        for router in self.routers.values():
            self.wait_view(router, lambda view: len(view) == p + d, "the whole fleet")

    def view(self, router: Server) -> dict[str, dict[str, Any]]:
        """The router's engines by URL (its ``/health``)."""
        body = httpx.get(router.url + "/health", timeout=5.0).json()
        return {e["url"]: e for role in ("prefill", "decode") for e in body.get(role, [])}

    def wait_view(
        self,
        router: Server,
        cond: Callable[[dict[str, dict[str, Any]]], bool],
        what: str,
        timeout_s: float = 60.0,
    ) -> float:
        """Poll the router's view until ``cond``; the seconds it took."""
        start = time.monotonic()
        while not cond(self.view(router)):
            for server in (*self.engines.values(), *self.routers.values()):
                if server.proc is not None and server.proc.poll() is not None:
                    raise RuntimeError(
                        f"{server.name} exited ({server.proc.returncode}): {server.log_tail()}"
                    )
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"{router.name}: no {what} after {timeout_s:.0f} s: {self.view(router)}")
            time.sleep(_POLL_S)
        return time.monotonic() - start


@dataclass
class Outcome:
    ok: int = 0
    failed: int = 0
    mismatched: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def case(self) -> dict[str, Any]:
        ms = [t * 1e3 for t in self.ttfts_s]
        return {
            "requests": self.ok + self.failed + self.mismatched,
            "ok": self.ok,
            "failed": self.failed,
            "mismatched": self.mismatched,
            "ttft_p50_ms": percentile(ms, 50) if ms else None,
            "ttft_p99_ms": percentile(ms, 99) if ms else None,
        }


class Load:
    """``concurrency`` client threads sending streamed completions to ``url`` until ``requests`` were sent
    or ``stop()``; each answer is compared with the colocated reference of its prompt."""

    def __init__(
        self,
        setup: FleetSetup,
        url: str,
        prompts: Sequence[str],
        reference: dict[str, list[int]],
        requests: int,
    ) -> None:
        self.setup = setup
        self.url = url
        self.prompts = prompts
        self.reference = reference
        self.requests = requests
        self.outcome = Outcome()
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next_at = 0.0
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(setup.concurrency)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _take(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.sent >= self.requests:
                return None
            self.sent += 1
            now = time.monotonic()
            at = self._next_at = max(self._next_at + 1.0 / self.setup.rate, now)
        time.sleep(at - now)  # paced: one request each 1/rate s, whichever client sends it
        return self.sent - 1

    def _worker(self) -> None:
        with httpx.Client() as client:
            while (i := self._take()) is not None:
                prompt = self.prompts[i % len(self.prompts)]
                s = self.setup
                try:
                    got = stream_completion(
                        client, self.url, s.model, prompt, s.max_tokens, s.request_timeout_s
                    )
                except (RequestFailed, httpx.HTTPError) as exc:
                    with self._lock:
                        self.outcome.failed += 1
                        self.outcome.errors.append(str(exc)[:300])
                    continue
                with self._lock:
                    if got.token_ids == self.reference[prompt]:
                        self.outcome.ok += 1
                        self.outcome.ttfts_s.append(got.ttft_s)
                    else:
                        self.outcome.mismatched += 1

    def wait_sent(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sent < n and time.monotonic() < deadline and any(t.is_alive() for t in self._threads):
            time.sleep(_POLL_S)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 120.0) -> Outcome:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.outcome


def reference_answers(colocated: Server, prompts: Sequence[str], setup: FleetSetup) -> dict[str, list[int]]:
    with httpx.Client() as client:
        args = (setup.max_tokens, setup.request_timeout_s)
        return {
            p: stream_completion(client, colocated.url, setup.model, p, *args).token_ids for p in set(prompts)
        }


def plain_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["fleet", "lease", "etcd", "prefill", "decode", "router", "block", "cache", "drain", "join"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def shared_prefix_prompts(groups: int, per_group: int, prefix_bytes: int, seed: int) -> list[str]:
    """Few-shot / multi-turn shaped prompts: ``groups`` long shared prefixes, each followed by
    ``per_group`` different short questions, in a random order."""
    rng = random.Random(seed)
    prefixes = []
    for g in range(groups):
        shots = [f"Q{k}: {rng.random():.6f} A{k}: {rng.random():.6f}." for k in range(prefix_bytes // 24 + 1)]
        prefixes.append(f"[system {g}] " + " ".join(shots)[:prefix_bytes])
    out = [
        f"{prefixes[g]} User: question {q} about {rng.randint(0, 999)}?"
        for q in range(per_group)
        for g in range(groups)
    ]
    rng.shuffle(out)  # arrivals in no pattern a rotation could line up with
    return out


def log_dir_for(base: Path | None) -> Path:
    return base if base is not None else Path(tempfile.mkdtemp(prefix="kvwire-fleet-"))
