"""Abort fencing over real NIXL (DESIGN.md §3 item 2; issue 6: >= 500 races on NIXL): P and D in two
processes, each driving its own connector through the same randomized schedule of requests and aborts,
reusing freed blocks at once with a known pattern (``kvwire.testing.nixl_races``). Zero corrupted bytes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import IO, Any

import pytest

from kvwire.testing import connnet
from kvwire.testing.faultnet import FaultWorker

pytestmark = pytest.mark.nixl

REQUESTS = 1200  # about 60% of them are aborted on one side or both
WINDOW = 64
NUM_BLOCKS = 512
LIMIT_S = 60.0  # each side's loop is bounded whatever happens
SEED = 6
ENV = {"UCX_MODULES": "^ib*", "PYTHONUNBUFFERED": "1"}


def test_abort_write_races_over_nixl_corrupt_nothing(tmp_path: Path) -> None:
    log: IO[Any] = open(tmp_path / "workers.log", "wb")  # noqa: SIM115 (closed in the finally below)
    procs: list[subprocess.Popen[bytes]] = []

    def popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        procs.append(proc)
        return proc

    # Only writes, aborts, their fencing and P's lease (for aborts P never hears of) end requests here.
    opts: dict[str, float] = {
        "lease_s": 0.5,
        "liveness_s": 30.0,
        "heartbeat_s": 0.2,
        "num_blocks": NUM_BLOCKS,
    }
    workers: list[FaultWorker] = []
    try:
        p = connnet.launch(popen, "p", "RP", "127.0.0.1", ENV, small=True, **opts)
        d = connnet.launch(popen, "d", "RD", "127.0.0.1", ENV, small=True, **opts)
        workers += [p, d]
        port = p.reply(60.0)["port"]
        d.reply(60.0)
        race = {"cmd": "race", "seed": SEED, "n": REQUESTS, "window": WINDOW, "limit_s": LIMIT_S}
        d.send(race | {"remote": {"engine_id": "RP", "host": "127.0.0.1", "port": port}})
        p.send(race)
        on_d = d.reply(LIMIT_S + 30.0)
        on_p = p.reply(LIMIT_S + 30.0)
        print("D:", on_d)
        print("P:", on_p)
        races = sum(1 for r in _plans() if r.d_abort_s is not None or r.p_abort_s is not None)
        print(f"{races} races over NIXL, corrupted bytes: {on_d['corrupted_ready_bytes']} in READY KV, "
              f"{on_d['corrupted_guard_bytes']} in reused blocks")  # fmt: skip
        assert races >= 500
        assert on_d["n_stuck"] == 0 and on_p["n_stuck"] == 0, (on_d, on_p)
        assert on_d["started"] == on_p["started"] == REQUESTS
        assert on_d["ready"] + on_d["released"] == on_d["guards_checked"] == REQUESTS
        assert on_d["corrupted_ready_bytes"] == 0
        assert on_d["corrupted_guard_bytes"] == 0
        assert on_d["ready"] > 0 and on_d["released"] > 0
        assert on_p.get("p_sent", 0) > 0 and on_p.get("p_aborted", 0) > 0
    finally:
        for worker in workers:
            worker.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5.0)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        log.close()


def _plans() -> list[Any]:
    from kvwire.testing.nixl_races import schedule

    return schedule(connnet.SMALL_SPEC, SEED, REQUESTS)
