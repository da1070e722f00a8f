"""Smoke test of `kvwire bench overhead --quick`: both backends run, the JSON has the issue's shape."""

from __future__ import annotations

import json
import threading
import time
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
        assert case["wait"] == "event"  # woken by the connectors, as an engine is
        for side in ("p", "d"):
            assert case[f"{side}_us"] > 0 and case[f"{side}_loop_us"] > 0 and case[f"{side}_call_us"] > 0
            # The control-plane figure is the side's CPU without the agent's transfer calls.
            total = case[f"{side}_loop_us"] + case[f"{side}_call_us"] - case[f"{side}_transfer_us"]
            assert case[f"{side}_us"] == pytest.approx(total)
            assert case[f"{side}_ratio_vs_goal"] == pytest.approx(case[f"{side}_us"] / case["goal_us"])
        assert case["p_transfer_us"] > 0 and case["wall_us"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bench_wakes_on_the_connectors_events_not_on_a_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--wait event`` a batch ends when the connectors' ``on_event`` wakes the bench: with the
    fallback wait made 30 s long, a batch of 4 still ends at once (a bench that missed the events would
    sit in that wait), and the wake-up was set by the connectors."""
    from kvwire.kv.spec import KVSpec
    from kvwire_tools.bench import overhead

    class CountingEvent(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.sets = 0

        def set(self) -> None:
            self.sets += 1
            super().set()

    monkeypatch.setattr(overhead, "EVENT_WAIT_S", 30.0)
    monkeypatch.setattr(overhead.threading, "Event", CountingEvent)
    spec = KVSpec(num_layers=2, kv_heads=1, head_dim=8, block_size=16)
    rig = overhead.Rig("inproc", spec, num_blocks=4, wait_event=True)
    woken = rig._woken
    assert isinstance(woken, CountingEvent)
    try:
        rig.batch([f"warm-{i}" for i in range(4)])  # handshakes
        sets = woken.sets
        t0 = time.monotonic()
        rig.batch([f"r-{i}" for i in range(4)])
        elapsed = time.monotonic() - t0
    finally:
        rig.close()
    assert elapsed < 5.0
    assert woken.sets > sets  # P's SENT and D's READY events woke it
