"""Smoke test of ``kvwire bench e2e --quick``: real server processes (colocated, and P, D and a router per
mode), answers identical to the colocated ones, the JSON shape of issue 7, a PNG; the serving figures in
``vllm bench serve``'s form (issue 14) and the mixed workload through always and conditional routers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main
from kvwire_tools.bench.e2e import Case, plan
from kvwire_tools.bench.e2e_mixed import LONG_EVERY, LONG_TOKENS, SHORT_TOKENS, mixed_prompts
from kvwire_tools.bench.serving import METRICS, Slo, TimedResult, serving_metrics

# vLLM's names (vllm bench serve --save-result), and kvwire's goodput share.
SERVING_KEYS = {
    "completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "goodput_fraction", "output_throughput", "total_token_throughput",
} | {f"{s}_{m}_ms" for m in METRICS for s in ("mean", "median", "std", "p50", "p90", "p99")}  # fmt: skip

pytestmark = pytest.mark.nixl


def test_plan_skips_waves_over_the_token_cap() -> None:
    run, skipped = plan((512, 4096), (1, 4), reps=2, max_wave_tokens=8192)
    assert run == [Case(512, 1, 2), Case(512, 4, 4), Case(4096, 1, 2)]
    assert skipped == [Case(4096, 4, 4)]
    assert plan((4096,), (16,), reps=2, max_wave_tokens=0) == ([Case(4096, 16, 16)], [])


def _timed(prompt_tokens: int, ttft_s: float, gaps: list[float]) -> TimedResult:
    r = TimedResult(prompt_tokens, token_ids=list(range(len(gaps) + 1)), ttft_s=ttft_s, itl_s=gaps)
    r.total_s = ttft_s + sum(gaps)
    return r


def test_serving_metrics_follow_vllm_definitions() -> None:
    results = [_timed(10, 0.1, [0.02, 0.02]), _timed(20, 0.3, []), _timed(30, 0.2, [0.05, 0.05, 0.05])]
    m = serving_metrics(results, duration_s=2.0, slo=Slo(ttft_ms=250, tpot_ms=30))
    assert set(m) == SERVING_KEYS
    assert (m["completed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 60, 8)
    assert (m["request_throughput"], m["output_throughput"], m["total_token_throughput"]) == (1.5, 4, 34)
    assert m["median_ttft_ms"] == pytest.approx(200) and m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear interpolation, as numpy and vLLM
    # TPOT per request with more than one token; ITL over every gap of every request.
    assert m["mean_tpot_ms"] == pytest.approx(35) and m["mean_itl_ms"] == pytest.approx(38)
    assert m["p99_e2el_ms"] == pytest.approx(349)
    # Good: only the first (TTFT 100, TPOT 20); the one-token answer has TPOT 0 but TTFT 300 > 250, the
    # last TPOT 50 > 30.
    assert m["goodput_fraction"] == pytest.approx(1 / 3) and m["request_goodput"] == pytest.approx(0.5)
    assert serving_metrics(results, 2.0, Slo())["request_goodput"] is None


def test_mixed_prompts_are_mostly_short_and_deterministic() -> None:
    prompts = mixed_prompts(20, seed=3)
    assert prompts == mixed_prompts(20, seed=3)
    sizes = [len(p) + 1 for p in prompts]  # ASCII: one token per character, plus BOS
    assert sum(LONG_TOKENS[0] <= n <= LONG_TOKENS[1] for n in sizes) == 20 // LONG_EVERY
    assert sum(SHORT_TOKENS[0] <= n <= SHORT_TOKENS[1] for n in sizes) == 20 - 20 // LONG_EVERY


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
        for key in ("serving", "colocated_serving"):
            assert set(case[key]) == SERVING_KEYS and case[key]["completed"] == 2
            assert case[key]["request_goodput"] is None  # no SLO given
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # starts engine servers and two routers: ~40 s
def test_bench_e2e_mixed_answers_agree_across_paths(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    args = ["bench", "e2e", "--workload", "mixed", "--quick", "--requests", "6", "--concurrency", "1", "2",
            "--slo-ttft-ms", "60000", "--json", str(out)]  # fmt: skip
    assert main(args) == 0  # non-zero when an answer differs from the colocated one
    doc = json.loads(out.read_text())
    assert doc["suite"] == "e2e" and doc["config"]["workload"] == "mixed"
    assert [c["case"] for c in doc["cases"]] == ["mixed-push-c1", "mixed-push-c2"]
    for case in doc["cases"]:
        assert case["mismatched"] == {"disaggregated": 0, "conditional": 0}
        assert set(case["paths"]) == set(case["ttft_ms"]) == {"colocated", "disaggregated", "conditional"}
        for m in case["paths"].values():
            assert set(m) == SERVING_KEYS and m["completed"] == 6 and m["goodput_fraction"] is not None
        # Short prompts were prefilled on D, long ones on P (or on D while P had more queued).
        made = case["conditional_decisions"]
        assert made.get("local/short_prompt", 0) == 6 - case["long_requests"] > 0
        assert sum(made.values()) == 6
