"""Smoke test of ``kvwire bench descriptors --quick``: it runs over real NIXL and writes the JSON shape."""

from __future__ import annotations

import json
from pathlib import Path

from kvwire.cli import main


def test_bench_descriptors_quick_json_shape(tmp_path: Path) -> None:
    out, plot = tmp_path / "descriptors.json", tmp_path / "descriptors.png"
    assert main(["bench", "descriptors", "--quick", "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "descriptors"
    assert set(doc["machine"]) >= {"cpus", "python", "nixl"}
    cases = doc["cases"]
    assert [c["case"] for c in cases] == ["contiguous", "half-fragmented", "scattered"]
    # 4 layers x (K, V) = 8 regions; 16 blocks: 1 run, 9 runs (8 in one run + 8 scattered), 16 runs.
    assert [c["descriptors"] for c in cases] == [8, 72, 128]
    assert [c["runs"] for c in cases] == [1, 9, 16]
    assert {c["bytes"] for c in cases} == {doc["request"]["bytes"]} == {4 * 2 * 256 * 8 * 128 * 2}
    for case in cases:
        for key in ("plan_us", "init_us", "setup_us", "complete_ms", "push_ms", "push_list_ms"):
            assert case[key] > 0, key
    assert cases[0]["setup_vs_contiguous"] == 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
