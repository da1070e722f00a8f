"""Smoke test of `kvwire bench handshake --quick`: runs over real NIXL, writes the issue's JSON shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main

pytestmark = pytest.mark.nixl


@pytest.mark.slow  # a real bench run: ~18 s
def test_bench_handshake_quick_json_shape(tmp_path: Path) -> None:
    out, plot = tmp_path / "handshake.json", tmp_path / "handshake.png"
    assert main(["bench", "handshake", "--quick", "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "handshake"
    assert [(c["regions"], c["blocks"]) for c in doc["cases"]] == [(8, 512), (64, 2000)]
    for case in doc["cases"]:
        assert set(case) >= {
            "regions",
            "blocks",
            "notif_only_ms",
            "full_ms",
            "nixl_add_agent_ms",
            "prep_all_blocks_ms",
        }
        for key in ("notif_only_ms", "full_ms", "nixl_add_agent_ms", "prep_all_blocks_ms"):
            assert case[key] > 0, key
        assert case["descriptors"] == case["regions"] * case["blocks"]
    many = doc["many_peers"]
    assert set(many) >= {"peers", "dead", "healthy_ms", "no_dead_ms"}
    assert many["peers"] == 4 and many["dead"] == 1 and many["healthy_ms"] > 0 and many["no_dead_ms"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
