"""Smoke test of `kvwire bench overhead --quick`: both backends run, the JSON has the issue's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main

pytestmark = pytest.mark.nixl


def test_bench_overhead_quick_json_shape(tmp_path: Path) -> None:
    out, plot = tmp_path / "overhead.json", tmp_path / "overhead.png"
    args = ["bench", "overhead", "--quick", "--requests", "24", "--warmup", "1", "--loops", "both"]
    assert main([*args, "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "overhead"
    assert set(doc["machine"]) >= {"cpus", "python", "nixl"}
    assert [(c["backend"], c["concurrency"], c["loops"]) for c in doc["cases"]] == [
        ("inproc", 1, "shared"),  # the in-process agents are not thread-safe: always one loop
        ("inproc", 8, "shared"),
        ("nixl", 1, "shared"),
        ("nixl", 8, "shared"),
        ("nixl", 1, "own"),  # as in an engine process
        ("nixl", 8, "own"),
    ]
    assert [c["case"] for c in doc["cases"]][2:] == ["nixl-c1-shared", "nixl-c8-shared", "nixl-c1", "nixl-c8"]
    for case in doc["cases"]:
        assert case["requests"] == 24 and case["descriptors_per_request"] == 8
        for side in ("p", "d"):
            assert case[f"{side}_us"] > 0 and case[f"{side}_loop_us"] > 0 and case[f"{side}_call_us"] > 0
            # The control-plane figure is the side's CPU without the agent's transfer calls.
            total = case[f"{side}_loop_us"] + case[f"{side}_call_us"] - case[f"{side}_transfer_us"]
            assert case[f"{side}_us"] == pytest.approx(total)
            assert case[f"{side}_ratio_vs_goal"] == pytest.approx(case[f"{side}_us"] / case["goal_us"])
        assert case["p_transfer_us"] > 0 and case["wall_us"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
