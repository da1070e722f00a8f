"""A real connector engine (``Producer`` or ``Consumer`` on NIXL) in its own process, for fault tests
across network namespaces.

``python -m kvwire.testing.connnet --role p|d --engine-id ID --host ADDR ...`` builds one engine (one
rank, NIXL backend: run it with ``UCX_TLS=tcp``), binds its side channel to ``ADDR`` (the namespace's
end of the veth: the peer must reach it, and nothing outside the two namespaces can), starts the
connector and talks to its parent over stdin/stdout like ``kvwire.testing.faultnet`` (one JSON object a
line, replies prefixed ``KVWT``; the parent drives it with ``faultnet.FaultWorker``). Between commands it
polls the connector every ~2 ms and stamps each event with ``time.monotonic()`` (one clock for every
network namespace), so the parent can time a detection from the moment it injected a fault.

Commands: ``finish`` (P: fill blocks with ``random_kv(seed)``, then ``request_finished``), ``allocate``
(D), ``events`` (every event so far), ``verify`` (D: bytes of a request's blocks that differ from
``random_kv(seed)``), ``stats``, ``race`` (this side of ``kvwire.testing.nixl_races``), ``stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.connector import ConnectorConfig, Consumer, ConsumerEvent, Producer, ProducerEvent, RemoteEngine
from kvwire.kv.spec import KVSpec
from kvwire.testing import nixl_races
from kvwire.testing.engines import EngineSetup, build_engine, gather_tokens, random_kv, scatter_tokens
from kvwire.testing.faultnet import FaultWorker, _reply

# 256 KiB per block over all regions (4 layers x k/v x 16 tokens x 8 heads x 128 x fp16).
SPEC = KVSpec(num_layers=4, kv_heads=8, head_dim=128, block_size=16)
# 512 B per block: the abort races want many small requests in flight.
SMALL_SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
_IDLE_POLL_S = 0.002


class _Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        spec = SMALL_SPEC if args.small else SPEC
        self.setup: EngineSetup = build_engine(
            args.engine_id, spec, num_blocks=args.num_blocks, backend="nixl"
        )
        cfg = ConnectorConfig(
            heartbeat_interval_s=args.heartbeat_s,
            liveness_timeout_s=args.liveness_s,
            dead_peer_grace_s=args.grace_s,
            transfer_timeout_s=args.transfer_timeout_s,
            kv_lease_duration_s=args.lease_s,
            fence_ms=args.fence_ms,
        )
        cls = Producer if args.role == "p" else Consumer
        self.conn: Producer | Consumer = cls(self.setup.engine, self.setup.ranks, cfg, host=args.host)
        self.events: list[dict[str, Any]] = []

    def pump(self) -> None:
        now = time.monotonic()
        for e in self.conn.poll():
            self.events.append(_describe(e, now))

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        op = cmd.get("cmd")
        if op == "finish":
            assert isinstance(self.conn, Producer)
            kv = random_kv(SPEC, int(cmd["num_tokens"]), int(cmd["seed"]))
            scatter_tokens(self.setup.ranks, cmd["blocks"], kv)
            self.conn.request_finished(str(cmd["tid"]), cmd["blocks"], int(cmd["num_tokens"]))
            return {"at": time.monotonic()}
        if op == "allocate":
            assert isinstance(self.conn, Consumer)
            remote = RemoteEngine(**cmd["remote"])
            self.conn.request_allocated(str(cmd["tid"]), cmd["blocks"], int(cmd["num_tokens"]), 0, remote)
            return {"at": time.monotonic()}
        if op == "events":
            self.pump()
            return {"events": self.events}
        if op == "verify":
            n = int(cmd["num_tokens"])
            got = gather_tokens(self.setup.ranks, cmd["blocks"], range(n))
            want = random_kv(SPEC, n, int(cmd["seed"]))
            bad = np.count_nonzero(got.view(np.uint8) != np.ascontiguousarray(want).view(np.uint8))
            return {"bad_bytes": int(bad), "checked_bytes": int(got.nbytes)}
        if op == "nonzero":  # bytes of these blocks that anything wrote (they start as zeros)
            return {
                "nonzero": int(
                    sum(np.count_nonzero(r.own_cache().slab[:, :, cmd["blocks"]]) for r in self.setup.ranks)
                )
            }
        if op == "stats":
            s = self.conn.stats
            return {
                "transfers_started": s.transfers_started,
                "transfers_done": s.transfers_done,
                "bytes": s.bytes_moved,
                "peers_declared_dead": s.peers_declared_dead,
                "failures": {k.value: v for k, v in s.failures.items()},
            }
        if op == "race":
            return self.race(cmd)
        if op == "stop":
            return None
        return {"error": f"unknown command {op!r}"}

    def race(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Run this side of ``nixl_races`` to its end (bounded by ``limit_s``)."""
        seed, n, window, limit_s = int(cmd["seed"]), int(cmd["n"]), int(cmd["window"]), float(cmd["limit_s"])
        if isinstance(self.conn, Producer):
            return nixl_races.race_p(self.conn, self.setup, seed, n, window, limit_s)
        return nixl_races.race_d(self.conn, self.setup, seed, n, window, limit_s, cmd["remote"])

    def close(self) -> None:
        self.conn.close()
        self.setup.close()


def _describe(e: ProducerEvent | ConsumerEvent, at: float) -> dict[str, Any]:
    if isinstance(e, ProducerEvent):
        return {"tid": e.transfer_id, "what": e.outcome.value, "at": at}
    what = e.kind.value if e.reason is None else f"{e.kind.value}:{e.reason.value}"
    return {"tid": e.transfer_id, "what": what, "at": at}


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwire.testing.connnet")
    parser.add_argument("--role", choices=("p", "d"), required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument("--liveness-s", type=float, default=1.0)
    parser.add_argument("--grace-s", type=float, default=0.2)
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--fence-ms", type=int, default=30_000)
    parser.add_argument("--small", action="store_true", help="tiny blocks (SMALL_SPEC), for many requests")
    args = parser.parse_args(argv)
    eng = _Engine(args)
    try:
        port = eng.conn.start()
        _reply({"ready": True, "port": port, "agent": eng.setup.ranks[0].agent.name, "pid": os.getpid()})
        stdin = sys.stdin.buffer
        while True:
            readable, _, _ = select.select([stdin], [], [], _IDLE_POLL_S)
            eng.pump()
            if not readable:
                continue
            line = stdin.readline()
            if not line:  # the parent went away
                return 0
            result = eng.handle(json.loads(line))
            if result is None:
                _reply({"bye": True})
                return 0
            _reply(result)
    finally:
        eng.close()


def launch(
    start: Callable[[list[str], dict[str, str]], subprocess.Popen[bytes]],
    role: str,
    engine_id: str,
    host: str,
    env: dict[str, str],
    *,
    small: bool = False,
    **options: float,
) -> FaultWorker:
    """Start a worker (``start`` runs argv with env, e.g. in a namespace); read its ready line with
    ``reply``. ``options``: heartbeat_s, liveness_s, grace_s, transfer_timeout_s, lease_s, fence_ms."""
    argv = [sys.executable, "-m", "kvwire.testing.connnet", "--role", role, "--engine-id", engine_id]
    argv += ["--host", host, *(["--small"] if small else [])]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return FaultWorker(start(argv, {**os.environ, **env}), f"{role}/{engine_id}")


if __name__ == "__main__":
    sys.exit(worker_main())
