"""``kvwire bench e2e --workload mixed``: many short prompts and some long ones, served three ways.

* ``colocated``: one colocated engine, no router (the baseline);
* ``disaggregated``: a router with ``--disaggregation always`` in front of one P and one D;
* ``conditional``: a router with ``--disaggregation conditional`` in front of the **same** P and D, which
  lets D prefill the short prompts (and a long one while P's queue is the longer) itself.

At each concurrency the same prompts, in the same order, go to each path in turn as a closed loop of
``concurrency`` streams; every figure of ``kvwire_tools.bench.serving`` is reported per path with the
colocated baseline from the same run, and the answers (greedy) are compared token for token with the
colocated ones. The conditional router's ``/metrics`` says how many requests it prefilled on D and why.
"""

from __future__ import annotations

import argparse
import enum
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path as Path_
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwire.config import LOCAL_PREFILL_MAX_TOKENS, Disaggregation
from kvwire.protocol.messages import TransferMode
from kvwire.testing.procs import Server, ServerGroup, free_port, server_env
from kvwire_tools.bench.common import counter_deltas, envelope, print_table
from kvwire_tools.bench.serving import (
    SERVING_COLUMNS,
    Slo,
    TimedResult,
    serving_cells,
    serving_metrics,
    stream_timed,
    timed_wave,
)
from kvwire_tools.demo.workload import make_prompt

SHORT_TOKENS = (16, 128)
LONG_TOKENS = (1024, 2048)
LONG_EVERY = 5  # one prompt in five is long
FULL_CONCURRENCY = (1, 4, 16)
QUICK_CONCURRENCY = (1, 4)
FULL_REQUESTS = 40
QUICK_REQUESTS = 20
MAX_TOKENS = 16


class Path(enum.Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    CONDITIONAL = "conditional"


@dataclass
class MixedCluster:
    urls: dict[Path, str]
    prefill: Server
    decode: Server


def mixed_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts, every ``LONG_EVERY``-th long, lengths drawn by ``seed``, order shuffled by it."""
    rng = random.Random(seed)
    sizes = [rng.randint(*(LONG_TOKENS if i % LONG_EVERY == 0 else SHORT_TOKENS)) for i in range(n)]
    rng.shuffle(sizes)
    return [make_prompt(k, rng) for k in sizes]


def _engine(group: ServerGroup, name: str, role: str, preset: str, mode: TransferMode | None) -> Server:
    port = free_port()
    args = ["serve", role, "--host", "127.0.0.1", "--port", str(port), "--preset", preset, "--seed", "0"]
    if mode is not None:
        args += ["--side-channel-port", str(free_port()), "--mode", mode.value]
    return group.start(name, args, port)


def start_mixed(
    group: ServerGroup, preset: str, mode: TransferMode, local_max: int | None, timeout_s: float
) -> MixedCluster:
    colocated = _engine(group, "colocated", "colocated", preset, None)
    p = _engine(group, "prefill", "prefill", preset, mode)
    d = _engine(group, "decode", "decode", preset, mode)
    group.wait_healthy([colocated, p, d], timeout_s)
    routers = {}
    for path, how in (
        (Path.DISAGGREGATED, Disaggregation.ALWAYS),
        (Path.CONDITIONAL, Disaggregation.CONDITIONAL),
    ):
        port = free_port()
        args = ["serve", "router", "--port", str(port), "--mode", mode.value, "--prefill", p.url,
                "--decode", d.url, "--disaggregation", how.value]  # fmt: skip
        if local_max is not None:
            args += ["--local-prefill-max-tokens", str(local_max)]
        routers[path] = group.start(f"router-{path.value}", args, port)
    group.wait_healthy(list(routers.values()), timeout_s)
    urls = {Path.COLOCATED: colocated.url, **{k: r.url for k, r in routers.items()}}
    return MixedCluster(urls, p, d)


def decisions(client: httpx.Client, router_url: str) -> dict[str, float]:
    """The router's prefill decisions so far, as ``site/reason`` -> count."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(router_url + "/metrics").text):
        for s in family.samples:
            if s.name == "kvwire_router_prefill_decisions_total":
                out[f"{s.labels['site']}/{s.labels['reason']}"] = s.value
    return out


def run_level(
    client: httpx.Client, cluster: MixedCluster, model: str, concurrency: int, cfg: MixedRun
) -> dict[str, Any]:
    """One concurrency level: every path gets the same prompts; figures and answers side by side."""
    prompts = mixed_prompts(cfg.requests, cfg.seed * 7919 + concurrency)
    results: dict[Path, list[TimedResult]] = {}
    paths: dict[str, Any] = {}
    made = decisions(client, cluster.urls[Path.CONDITIONAL])
    with ThreadPoolExecutor(concurrency, thread_name_prefix="kvwire-mixed") as pool:
        for path in Path:
            wave = timed_wave(pool, client, cluster.urls[path], model, prompts, cfg.max_tokens, cfg.timeout_s)
            results[path] = wave.results
            paths[path.value] = serving_metrics(wave.results, wave.duration_s, cfg.slo)
    base = results[Path.COLOCATED]
    mismatched = {
        p.value: sum(
            a.token_ids != b.token_ids or a.text != b.text for a, b in zip(results[p], base, strict=True)
        )
        for p in (Path.DISAGGREGATED, Path.CONDITIONAL)
    }
    return {
        "case": f"mixed-{cfg.mode.value}-c{concurrency}",
        "workload": "mixed",
        "mode": cfg.mode.value,
        "concurrency": concurrency,
        "requests": cfg.requests,
        "long_requests": sum(len(p) + 1 >= LONG_TOKENS[0] for p in prompts),
        "ttft_ms": {k: {"p50": v["p50_ttft_ms"], "p99": v["p99_ttft_ms"]} for k, v in paths.items()},
        "paths": paths,
        "mismatched": mismatched,
        "conditional_decisions": counter_deltas(made, decisions(client, cluster.urls[Path.CONDITIONAL])),
    }


@dataclass(frozen=True)
class MixedRun:
    mode: TransferMode
    requests: int
    max_tokens: int
    seed: int
    timeout_s: float
    slo: Slo


def plan(args: argparse.Namespace) -> tuple[MixedRun, Sequence[int]]:
    quick = bool(args.quick)
    mode = TransferMode(args.modes[0]) if args.modes else TransferMode.PUSH
    run = MixedRun(
        mode=mode,
        requests=args.requests or (QUICK_REQUESTS if quick else FULL_REQUESTS),
        max_tokens=args.max_tokens or MAX_TOKENS,
        seed=args.seed,
        timeout_s=args.request_timeout,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
    )
    return run, args.concurrency or (QUICK_CONCURRENCY if quick else FULL_CONCURRENCY)


def measure_mixed(args: argparse.Namespace) -> dict[str, Any]:
    run, levels = plan(args)
    preset = "tiny" if args.quick else args.preset
    log_dir = tempfile.mkdtemp(prefix="kvwire-bench-mixed-")
    rows, ok, started = [], False, time.monotonic()
    try:
        with ServerGroup(Path_(log_dir), server_env()) as group:
            cluster = start_mixed(
                group, preset, run.mode, args.local_prefill_max_tokens, args.startup_timeout
            )
            limits = httpx.Limits(max_connections=2 * max(levels) + 8)
            with httpx.Client(limits=limits, timeout=args.request_timeout) as client:
                model = str(
                    client.get(cluster.urls[Path.COLOCATED] + "/health").json().get("model") or "kvwire"
                )
                for url in cluster.urls.values():  # warm-up, not counted: imports, allocations, handshakes
                    stream_timed(client, url, model, "warm up", 2, args.request_timeout)
                for c in levels:
                    t0 = time.monotonic()
                    rows.append(run_level(client, cluster, model, c, run))
                    group.check_all_alive()
                    print(
                        f"e2e mixed c{c}: {run.requests} requests per path, {time.monotonic() - t0:.1f} s",
                        flush=True,
                    )
        ok = True
    finally:
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"e2e mixed: server logs kept in {log_dir}", flush=True)
    doc = envelope("e2e", rows)
    doc["config"] = {
        "workload": "mixed", "preset": preset, "mode": run.mode.value, "max_tokens": run.max_tokens,
        "short_tokens": list(SHORT_TOKENS), "long_tokens": list(LONG_TOKENS), "long_every": LONG_EVERY,
        "local_prefill_max_tokens": args.local_prefill_max_tokens or LOCAL_PREFILL_MAX_TOKENS,
        "slo": run.slo.to_json(), "wall_s": time.monotonic() - started,
    }  # fmt: skip
    return doc


def mismatched_total(doc: dict[str, Any]) -> int:
    return sum(sum(r["mismatched"].values()) for r in doc["cases"])


def print_mixed(doc: dict[str, Any]) -> None:
    rows = []
    for r in doc["cases"]:
        for path, m in r["paths"].items():
            rows.append((f"c{r['concurrency']}", path, m["completed"], *serving_cells(m)))
    slo = doc["config"]["slo"]
    title = (
        f"e2e mixed ({doc['config']['mode']}): short {SHORT_TOKENS} and 1 in {LONG_EVERY} long {LONG_TOKENS} "
        f"prompt tokens, max_tokens {doc['config']['max_tokens']}; ms; goodput under SLO TTFT "
        f"{slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms"
    )
    print_table(title, ("conc", "path", "reqs", *SERVING_COLUMNS), rows)
    for r in doc["cases"]:
        print(
            f"c{r['concurrency']}: conditional router prefill decisions {r['conditional_decisions']}; "
            f"answers differing from colocated {r['mismatched']}"
        )


def plot_mixed(path: str, doc: dict[str, Any]) -> None:
    """TTFT p50 (left) and p99 (right) per concurrency, one bar per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["cases"]
    levels = [f"c{r['concurrency']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(Path)
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        for k, p in enumerate(Path):
            xs = [i + (k - (len(Path) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [r["ttft_ms"][p.value][q] or 0.0 for r in rows], width, label=p.value)
        ax.set_yscale("log")  # c1's tens of ms and c16's seconds on one axis
        ax.set_xticks(range(len(rows)), levels)
        ax.set(xlabel="concurrency", ylabel=f"TTFT {q} (ms)", title=f"mixed workload: TTFT {q}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
