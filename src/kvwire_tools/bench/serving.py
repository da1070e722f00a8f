"""Serving figures in ``vllm bench serve``'s form, so kvwire's numbers can be put beside vLLM's.

Per request the client times the first token (TTFT), each later token's gap (ITL), the whole request
(E2EL), and derives TPOT (``(E2EL - TTFT) / (output tokens - 1)``). ``serving_metrics`` summarises one wave
with vLLM's JSON keys: ``completed``, ``duration``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput``, ``output_throughput``, ``total_token_throughput``, ``request_goodput`` and, per
metric in ``ttft``, ``tpot``, ``itl``, ``e2el``: ``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and
``p50/p90/p99_*_ms`` (numpy's linear-interpolated percentiles, as vLLM computes them). Goodput follows
vLLM's ``--goodput``: a request is good when it meets every SLO given (TTFT and TPOT here; a one-token
answer has TPOT 0); ``request_goodput`` is good requests per second of the wave and ``goodput_fraction``
the share of requests that were good (a kvwire addition: it does not depend on the wave's length).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from kvwire_tools.demo.workload import RequestFailed, Result

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in milliseconds (None: not judged)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


@dataclass
class TimedResult(Result):
    """A streamed completion with every inter-token gap (seconds), as ``vllm bench serve`` keeps them."""

    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_or_zero_s(self) -> float:
        """TPOT for the goodput test: 0 for a one-token answer (vLLM's rule)."""
        tpot = self.tpot_s
        return 0.0 if tpot is None else tpot


def stream_timed(
    client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, timeout_s: float
) -> TimedResult:
    """POST a greedy streaming completion and time its first token and every later chunk of tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    result = TimedResult(prompt_tokens=len(prompt.encode()) + 1)
    start = time.perf_counter()
    last = start
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RequestFailed(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            got = _take(result, json.loads(data))
            if got:
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                    got -= 1  # tokens arriving with the first share its time
                # A chunk of several tokens spreads its gap over them (vLLM counts one per chunk).
                result.itl_s += [(now - last) / got] * got if got else []
                last = now
    result.total_s = time.perf_counter() - start
    if not result.token_ids and not result.text:
        raise RequestFailed(f"{url}: the stream carried no tokens")
    return result


@dataclass
class Wave:
    results: list[TimedResult]
    duration_s: float  # first request sent to last answer in


def timed_wave(
    pool: Executor,
    client: httpx.Client,
    url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    timeout_s: float,
) -> Wave:
    """Every prompt through ``pool`` (its workers are the concurrency: a closed loop), results in order."""
    t0 = time.perf_counter()
    futures = [pool.submit(stream_timed, client, url, model, p, max_tokens, timeout_s) for p in prompts]
    results = [f.result() for f in futures]
    return Wave(results, time.perf_counter() - t0)


def _take(result: TimedResult, event: Mapping[str, Any]) -> int:
    """Fold one SSE event into ``result``; returns how many tokens it carried."""
    if event.get("error") is not None:
        raise RequestFailed(f"stream error: {event['error']}")
    if isinstance(event.get("timings"), dict):
        result.timings = event["timings"]
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return 0
    ids = choices[0].get("token_ids") or []
    text = choices[0].get("text") or ""
    result.token_ids.extend(int(t) for t in ids)
    result.text += text
    return len(ids) if ids else (1 if text else 0)


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    out: dict[str, float | None] = {}
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = None if empty else float(ms.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return out


def is_good(r: TimedResult, slo: Slo) -> bool:
    ttft_ok = slo.ttft_ms is None or r.ttft_s * 1e3 <= slo.ttft_ms
    tpot_ok = slo.tpot_ms is None or r.tpot_or_zero_s * 1e3 <= slo.tpot_ms
    return ttft_ok and tpot_ok


def serving_metrics(results: Sequence[TimedResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    """One wave's figures under vLLM's names (``duration`` in seconds, the rest as vLLM has them)."""
    n_in = sum(r.prompt_tokens for r in results)
    n_out = sum(len(r.token_ids) for r in results)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(is_good(r, slo) for r in results) if slo.given else None
    out: dict[str, Any] = {
        "completed": len(results),
        "duration": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(results) * per_s,
        "request_goodput": None if good is None else good * per_s,
        "goodput_fraction": None if good is None or not results else good / len(results),
        "output_throughput": n_out * per_s,
        "total_token_throughput": (n_in + n_out) * per_s,
    }
    tpots = [t for r in results if (t := r.tpot_s) is not None]
    series = {
        "ttft": [r.ttft_s for r in results],
        "tpot": tpots,
        "itl": [gap for r in results for gap in r.itl_s],
        "e2el": [r.total_s for r in results],
    }
    for name in METRICS:
        out.update(_stats(name, series[name]))
    return out


SERVING_COLUMNS = (
    "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
    "E2EL p50", "E2EL p99", "req/s", "out tok/s", "goodput",
)  # fmt: skip


def serving_cells(m: Mapping[str, Any]) -> tuple[object, ...]:
    """One row of ``SERVING_COLUMNS`` (ms, then throughputs; goodput as req/s and % of requests)."""
    keys = ("mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
            "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms", "request_throughput",
            "output_throughput")  # fmt: skip
    cells: list[object] = [_round(m[k]) for k in keys]
    frac = m.get("goodput_fraction")
    goodput = "-" if frac is None else f"{m['request_goodput']:.2f} ({frac:.0%})"
    return (*cells, goodput)


def _round(v: Any) -> object:
    return "-" if v is None else round(float(v), 2)
