"""``kvwire bench fleet`` end to end (slow: a 2P2D fleet, five scenarios, two routing policies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.nixl]


def test_bench_fleet_discovery_meets_its_goals(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    # --rate 8: on this 2-core host at the default 20 req/s the queue term of the prefix-aware score
    # outweighs the cached tokens (the reference engines have no prefix cache to make a hit pay), and its
    # hit rate came within 0.015 of round robin's in one of four runs (0.40 < 0.49 once, with the index's
    # eviction bug); at 8 req/s, 0.74 vs 0.44-0.52 in two runs: the test checks the affinity, the bench's
    # default rate measures the loaded case.
    cmd = [sys.executable, "-m", "kvwire.cli", "bench", "fleet", "--requests", "12", "--rate", "8",
           "--routing-requests", "32", "--cost-picks", "200", "--json", str(out),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["suite"] == "fleet"
    cases = {c["scenario"]: c for c in doc["cases"]}
    assert set(cases) == {"steady", "join", "drain", "rolling", "kill"}
    for name in ("steady", "join", "drain", "rolling"):
        assert cases[name]["failed"] == 0 and cases[name]["mismatched"] == 0, cases[name]
        assert cases[name]["ok"] == cases[name]["requests"] > 0
    assert cases["kill"]["failed"] <= cases["kill"]["in_flight_at_kill"]
    assert cases["kill"]["mismatched"] == 0
    assert cases["join"]["join_to_traffic_s"] <= 2.0
    assert cases["drain"]["exit_status"] == 0 and cases["rolling"]["exit_statuses"] == [0, 0, 0, 0]
    routing = {r["policy"]: r for r in doc["routing"]}
    assert set(routing) == {"round_robin", "prefix_aware"}
    assert routing["prefix_aware"]["prefix_hit_rate"] > routing["round_robin"]["prefix_hit_rate"]
    assert all(r["failed"] == 0 and r["mismatched"] == 0 for r in doc["routing"])
    assert [c["engines"] for c in doc["router_cost"]] == [4, 8, 16, 32, 64]
