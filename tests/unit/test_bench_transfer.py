"""Smoke test of ``kvwire bench transfer`` at tiny sizes: it runs over real NIXL and writes the JSON shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main


@pytest.mark.slow  # a real bench run: ~20 s
def test_bench_transfer_small_json_shape(tmp_path: Path) -> None:
    out, plot = tmp_path / "transfer.json", tmp_path / "transfer.png"
    assert main(["bench", "transfer", "--small", "--reps", "2", "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "transfer"
    assert set(doc["machine"]) >= {"cpus", "python", "nixl"}
    names = [c["case"] for c in doc["cases"]]
    assert names == ["64KiB", "1MiB", "256x4KiB-scattered", "kv-256t-contiguous", "kv-256t-fragmented"]
    for case in doc["cases"][3:]:
        assert case["bytes"] == 4 * 2 * 256 * 8 * 128 * 2  # 4 layers, K and V, 256 tokens, 8 x 128 bf16
        assert case["descriptors"] == (8 if case["case"].endswith("contiguous") else 128)
        for key in ("kvwire_gbps", "kvwire_lanes2_gbps", "ratio_vs_nixl", "ratio_vs_memcpy"):
            assert case[key] > 0, key
    for case in doc["cases"]:
        assert set(case) >= {"case", "bytes", "nixl_gbps", "memcpy_gbps"}
        assert case["bytes"] > 0 and case["nixl_gbps"] > 0 and case["memcpy_gbps"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
