"""Smoke test of ``kvwire bench e2e --quick``: real server processes (colocated, and P, D and a router per
mode), answers identical to the colocated ones, the JSON shape of issue 7, a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.bench.e2e import Case, plan
from kvwire.cli import main

pytestmark = pytest.mark.nixl


def test_plan_skips_waves_over_the_token_cap() -> None:
    run, skipped = plan((512, 4096), (1, 4), reps=2, max_wave_tokens=8192)
    assert run == [Case(512, 1, 2), Case(512, 4, 4), Case(4096, 1, 2)]
    assert skipped == [Case(4096, 4, 4)]
    assert plan((4096,), (16,), reps=2, max_wave_tokens=0) == ([Case(4096, 16, 16)], [])


@pytest.mark.slow  # starts engine servers: ~20 s
def test_bench_e2e_quick_json_shape(tmp_path: Path) -> None:
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    args = ["bench", "e2e", "--quick", "--sizes", "48", "--json", str(out), "--plot", str(png)]
    assert main(args) == 0  # non-zero when a disaggregated answer differs from the colocated one
    doc = json.loads(out.read_text())
    assert doc["suite"] == "e2e" and set(doc["machine"]) >= {"cpus", "python", "nixl"}
    assert [c["case"] for c in doc["cases"]] == ["push-48-c1", "pull-48-c1", "push-48-c2", "pull-48-c2"]
    for case in doc["cases"]:
        assert case["mismatched"] == 0 and case["requests"] == 2
        for key in ("ttft_ms", "colocated_ttft_ms"):
            assert 0 < case[key]["p50"] <= case[key]["p99"]
        assert case["ratio_p50"] == pytest.approx(case["ttft_ms"]["p50"] / case["colocated_ttft_ms"]["p50"])
        b = case["breakdown"]
        # Every request moved its KV: the poster counted a transfer, P and D reported their TTFTs.
        assert b["transfer_ms"] > 0 and b["p_prefill_ms"] > 0 and b["d_engine_ttft_ms"] > 0
        assert b["d_kv_wait_ms"] is not None and b["colocated_engine_ttft_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
