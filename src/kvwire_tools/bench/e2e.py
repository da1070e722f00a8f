"""``kvwire bench e2e``: time to first token, disaggregated (router -> P -> KV over NIXL -> D) against
colocated (one engine), on the reference engine, push and pull, at several prompt lengths and
concurrencies.

Every server is a separate process (the demo's ``ServerGroup``): one colocated engine, and per transfer
mode a prefill engine, a decode engine and a router. Each case is one (prompt length, concurrency): the
colocated engine gets its requests first, then each mode's router the same prompts, each path as a
closed wave of ``concurrency`` streams. TTFT is timed at the client (first streamed token).

Where a disaggregated request's time goes, per case (means over its requests; engines' own figures):

* ``p_prefill``: P's TTFT (arrival to its one token: queueing and prefill), from P's ``/metrics``;
* ``transfer``: the KV transfer, post to done, of whoever posts (P in push, D in pull), ``/v1/kv_stats``;
* ``d_kv_wait``: D waiting for the KV (push: from D's admission, so it overlaps P's prefill; pull: the
  reads after P's leg), and ``d_after_kv``: D's TTFT past that (its queueing and first step);
* ``colocated_engine``: the colocated engine's own TTFT (prefill and first token).

Long prompts on this CPU engine take seconds each, so waves whose prompt tokens (concurrency x prompt
length) exceed ``--max-wave-tokens`` are skipped and listed under ``skipped`` in the JSON.

Each case also carries ``serving`` and ``colocated_serving``: ``vllm bench serve``'s figures (TTFT, TPOT, ITL
and E2EL mean/median/std/p50/p90/p99, request and token throughput, goodput under ``--slo-ttft-ms`` /
``--slo-tpot-ms``; ``kvwire_tools.bench.serving``). ``--workload mixed`` runs
``kvwire_tools.bench.e2e_mixed`` instead.
"""

from __future__ import annotations

import argparse
import enum
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwire.protocol.messages import TransferMode
from kvwire.testing.procs import Server, ServerGroup, free_port, server_env
from kvwire_tools.bench import e2e_mixed
from kvwire_tools.bench.common import envelope, print_table, write_json
from kvwire_tools.bench.serving import (
    SERVING_COLUMNS,
    Slo,
    TimedResult,
    Wave,
    serving_cells,
    serving_metrics,
    timed_wave,
)
from kvwire_tools.demo.report import percentile
from kvwire_tools.demo.workload import Result, make_prompt

GOAL_RATIO = 1.10
GOAL_TOKENS = 4096
FULL_SIZES = (512, 2048, 4096)
FULL_CONCURRENCY = (1, 4, 16)
QUICK_SIZES = (32, 128)
QUICK_CONCURRENCY = (1, 2)
MODES = (TransferMode.PUSH, TransferMode.PULL)
MAX_TOKENS = 4  # TTFT is the figure; a few decode steps show the stream works


class Workload(enum.Enum):
    SWEEP = "sweep"  # one prompt length per case, disaggregated against colocated
    MIXED = "mixed"  # short and long prompts: colocated, always and conditionally disaggregated


@dataclass(frozen=True, slots=True)
class Case:
    prompt_tokens: int
    concurrency: int
    requests: int

    @property
    def label(self) -> str:
        size = f"{self.prompt_tokens // 1024}k" if self.prompt_tokens % 1024 == 0 else str(self.prompt_tokens)
        return f"{size}-c{self.concurrency}"


@dataclass
class Cluster:
    colocated: Server
    # Per mode: (prefill, decode, router).
    disagg: dict[TransferMode, tuple[Server, Server, Server]]


def _engine_args(
    role: str, port: int, preset: str, num_blocks: int | None, mode: TransferMode | None
) -> list[str]:
    args = ["serve", role, "--host", "127.0.0.1", "--port", str(port), "--preset", preset, "--seed", "0"]
    if num_blocks is not None:
        args += ["--num-blocks", str(num_blocks)]
    if mode is not None:
        args += ["--side-channel-port", str(free_port()), "--mode", mode.value]
    return args


def start_cluster(
    group: ServerGroup, preset: str, num_blocks: int | None, modes: Sequence[TransferMode], timeout_s: float
) -> Cluster:
    def engine(name: str, role: str, mode: TransferMode | None) -> Server:
        port = free_port()
        return group.start(name, _engine_args(role, port, preset, num_blocks, mode), port)

    colocated = engine("colocated", "colocated", None)
    engines = {
        m: (engine(f"prefill-{m.value}", "prefill", m), engine(f"decode-{m.value}", "decode", m))
        for m in modes
    }
    group.wait_healthy([colocated, *(s for pair in engines.values() for s in pair)], timeout_s)
    disagg = {}
    for mode, (p, d) in engines.items():
        port = free_port()
        args = [
            "serve",
            "router",
            "--port",
            str(port),
            "--mode",
            mode.value,
            "--prefill",
            p.url,
            "--decode",
            d.url,
        ]
        disagg[mode] = (p, d, group.start(f"router-{mode.value}", args, port))
    group.wait_healthy([r for _, _, r in disagg.values()], timeout_s)
    return Cluster(colocated, disagg)


# -- engine-side figures ------------------------------------------------------------------------------------
def _ttft_sum_count(client: httpx.Client, url: str) -> tuple[float, float]:
    total, count = 0.0, 0.0
    for family in text_string_to_metric_families(client.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "kvwire_ttft_seconds_sum":
                total += sample.value
            elif sample.name == "kvwire_ttft_seconds_count":
                count += sample.value
    return total, count


def _kv_stats(client: httpx.Client, urls: Sequence[str]) -> tuple[int, int, float]:
    transfers, nbytes, seconds = 0, 0, 0.0
    for url in urls:
        snap = client.get(url + "/v1/kv_stats").json()
        transfers += int(snap.get("transfers", 0))
        nbytes += int(snap.get("bytes", 0))
        seconds += float(snap.get("transfer_seconds", 0.0))
    return transfers, nbytes, seconds


@dataclass
class Snapshot:
    p_ttft: tuple[float, float]
    kv: tuple[int, int, float]

    @classmethod
    def take(cls, client: httpx.Client, p: Server, d: Server) -> Snapshot:
        return cls(_ttft_sum_count(client, p.url), _kv_stats(client, [p.url, d.url]))


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _timing(results: Sequence[Result], key: str) -> list[float]:
    out = []
    for r in results:
        value = (r.timings or {}).get(key)
        if isinstance(value, int | float):
            out.append(float(value))
    return out


def breakdown(
    before: Snapshot, after: Snapshot, disagg: Sequence[Result], coloc: Sequence[Result]
) -> dict[str, Any]:
    (s0, c0), (s1, c1) = before.p_ttft, after.p_ttft
    n = after.kv[0] - before.kv[0]
    nbytes, secs = after.kv[1] - before.kv[1], after.kv[2] - before.kv[2]
    d_ttft, d_wait = _timing(disagg, "ttft_ms"), _timing(disagg, "kv_transfer_ms")
    after_kv = [t - w for t, w in zip(d_ttft, d_wait, strict=False)] if len(d_ttft) == len(d_wait) else []
    return {
        "p_prefill_ms": (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None,
        "transfer_ms": secs / n * 1e3 if n else None,
        "transfer_gbps": nbytes / secs / 1e9 if secs > 0 else None,
        "d_kv_wait_ms": _mean(d_wait),
        "d_after_kv_ms": _mean(after_kv),
        "d_engine_ttft_ms": _mean(d_ttft),
        "colocated_engine_ttft_ms": _mean(_timing(coloc, "ttft_ms")),
    }


# -- running cases ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WaveSpec:
    concurrency: int
    max_tokens: int
    timeout_s: float


def wave(client: httpx.Client, url: str, model: str, prompts: Sequence[str], spec: WaveSpec) -> Wave:
    with ThreadPoolExecutor(spec.concurrency, thread_name_prefix="kvwire-e2e") as pool:
        return timed_wave(pool, client, url, model, prompts, spec.max_tokens, spec.timeout_s)


def _ms(results: Sequence[TimedResult]) -> dict[str, float | None]:
    ttfts = [r.ttft_s * 1e3 for r in results]
    return {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_case(
    client: httpx.Client, cluster: Cluster, model: str, case: Case, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rng = random.Random(args.seed * 7919 + case.prompt_tokens * 31 + case.concurrency)
    prompts = [make_prompt(case.prompt_tokens, rng) for _ in range(case.requests)]
    spec = WaveSpec(case.concurrency, args.max_tokens or MAX_TOKENS, args.request_timeout)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    coloc_wave = wave(client, cluster.colocated.url, model, prompts, spec)
    coloc = coloc_wave.results
    out = []
    for mode, (p, d, router) in cluster.disagg.items():
        before = Snapshot.take(client, p, d)
        disagg_wave = wave(client, router.url, model, prompts, spec)
        disagg = disagg_wave.results
        after = Snapshot.take(client, p, d)
        ttft, coloc_ttft = _ms(disagg), _ms(coloc)
        mismatched = sum(a.token_ids != b.token_ids for a, b in zip(disagg, coloc, strict=True))
        row: dict[str, Any] = {
            "case": f"{mode.value}-{case.label}",
            "mode": mode.value,
            "prompt_tokens": case.prompt_tokens,
            "concurrency": case.concurrency,
            "requests": case.requests,
            "ttft_ms": ttft,
            "colocated_ttft_ms": coloc_ttft,
            "ratio_p50": _ratio(ttft["p50"], coloc_ttft["p50"]),
            "ratio_p99": _ratio(ttft["p99"], coloc_ttft["p99"]),
            "mismatched": mismatched,
            "breakdown": breakdown(before, after, disagg, coloc),
            "serving": serving_metrics(disagg, disagg_wave.duration_s, slo),
            "colocated_serving": serving_metrics(coloc, coloc_wave.duration_s, slo),
        }
        if case.prompt_tokens >= GOAL_TOKENS:
            row["goal_ratio"] = GOAL_RATIO
            row["goal_met"] = row["ratio_p50"] is not None and row["ratio_p50"] <= GOAL_RATIO
        out.append(row)
    return out


def plan(
    sizes: Sequence[int], concurrency: Sequence[int], reps: int, max_wave_tokens: int
) -> tuple[list[Case], list[Case]]:
    """(cases to run, cases skipped because their wave is longer than ``max_wave_tokens``)."""
    run: list[Case] = []
    skipped: list[Case] = []
    for size in sizes:
        for c in concurrency:
            case = Case(size, c, max(c, reps))
            too_long = max_wave_tokens > 0 and c * size > max_wave_tokens
            (skipped if too_long else run).append(case)
    return run, skipped


def measure(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    preset = "tiny" if quick else args.preset
    sizes = args.sizes or (QUICK_SIZES if quick else FULL_SIZES)
    conc = args.concurrency or (QUICK_CONCURRENCY if quick else FULL_CONCURRENCY)
    modes = [TransferMode(m) for m in args.modes or [m.value for m in MODES]]
    cases, skipped = plan(sizes, conc, args.reps, 0 if quick else args.max_wave_tokens)
    num_blocks = None if quick else args.num_blocks
    log_dir = Path(tempfile.mkdtemp(prefix="kvwire-bench-e2e-"))
    env = server_env()
    rows: list[dict[str, Any]] = []
    ok = False
    started = time.monotonic()
    try:
        with ServerGroup(log_dir, env) as group:
            cluster = start_cluster(group, preset, num_blocks, modes, args.startup_timeout)
            limits = httpx.Limits(max_connections=2 * max(conc) + 8)
            with httpx.Client(limits=limits, timeout=args.request_timeout) as client:
                model = str(client.get(cluster.colocated.url + "/health").json().get("model") or "kvwire")
                # Warm-up, not counted: lazy imports, first allocations, the handshakes.
                warm = WaveSpec(1, 2, args.request_timeout)
                for url in (cluster.colocated.url, *(r.url for _, _, r in cluster.disagg.values())):
                    wave(client, url, model, ["warm up"], warm)
                for case in cases:
                    t0 = time.monotonic()
                    rows += run_case(client, cluster, model, case, args)
                    group.check_all_alive()
                    print(
                        f"e2e {case.label}: {case.requests} requests per path, {time.monotonic() - t0:.1f} s",
                        flush=True,
                    )
        ok = True
    finally:
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"e2e: server logs kept in {log_dir}", flush=True)
    doc = envelope("e2e", rows)
    doc["config"] = {
        "preset": preset,
        "num_blocks": num_blocks,
        "workload": Workload.SWEEP.value,
        "max_tokens": args.max_tokens or MAX_TOKENS,
        "slo": Slo(args.slo_ttft_ms, args.slo_tpot_ms).to_json(),
        "max_wave_tokens": args.max_wave_tokens,
        "wall_s": time.monotonic() - started,
    }
    doc["skipped"] = [
        {
            "case": c.label,
            "prompt_tokens": c.prompt_tokens,
            "concurrency": c.concurrency,
            "why": "wave too long",
        }
        for c in skipped
    ]
    return doc


# -- output -------------------------------------------------------------------------------------------------
def _f(v: Any) -> Any:
    return "-" if v is None else v


def print_results(doc: dict[str, Any]) -> None:
    columns = ("case", "reqs", "disagg p50", "coloc p50", "x p50", "disagg p99", "coloc p99", "x p99",
               "P prefill", "transfer", "GB/s", "D kv wait", "D after kv", "coloc engine")  # fmt: skip
    rows = []
    for r in doc["cases"]:
        b, t, c = r["breakdown"], r["ttft_ms"], r["colocated_ttft_ms"]
        keys = ("p_prefill_ms", "transfer_ms", "transfer_gbps", "d_kv_wait_ms", "d_after_kv_ms")
        rows.append(
            (r["case"], r["requests"], t["p50"], c["p50"], r["ratio_p50"], t["p99"], c["p99"], r["ratio_p99"],
             *(b[k] for k in keys), b["colocated_engine_ttft_ms"])
        )  # fmt: skip
    rows = [tuple(_f(v) for v in row) for row in rows]
    print_table(
        f"e2e: TTFT ms, disaggregated vs colocated (goal at {GOAL_TOKENS}: <= {GOAL_RATIO}x)", columns, rows
    )
    serving = []
    for r in doc["cases"]:
        serving.append((r["case"], "disaggregated", *serving_cells(r["serving"])))
        serving.append((r["case"], "colocated", *serving_cells(r["colocated_serving"])))
    slo = doc["config"]["slo"]
    title = f"e2e serving figures (ms; goodput under SLO TTFT {slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms)"
    print_table(title, ("case", "path", *SERVING_COLUMNS), serving)
    for s in doc["skipped"]:
        print(f"skipped {s['case']}: {s['why']} (> --max-wave-tokens {doc['config']['max_wave_tokens']})")


def plot(path: str | Path, doc: dict[str, Any]) -> None:
    """Left: TTFT p50 per (prompt, concurrency), colocated and each mode. Right: the ratios and the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["cases"]
    labels = list(dict.fromkeys(r["case"].split("-", 1)[1] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["mode"], r["case"].split("-", 1)[1]): r for r in rows}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    series = {"colocated": [by[(modes[0], lab)]["colocated_ttft_ms"]["p50"] for lab in labels]}
    for m in modes:
        series[f"disagg {m}"] = [by[(m, lab)]["ttft_ms"]["p50"] for lab in labels]
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax1.bar(
            [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))], values, width, label=name
        )
    ax1.set_yscale("log")
    ax1.set(ylabel="TTFT p50 (ms)", title="time to first token")
    width = 0.8 / len(modes)
    for k, m in enumerate(modes):
        ratios = [by[(m, lab)]["ratio_p50"] or 0.0 for lab in labels]
        ax2.bar([i + (k - (len(modes) - 1) / 2) * width for i in range(len(labels))], ratios, width, label=m)
    ax2.axhline(
        GOAL_RATIO, color="red", linestyle="--", linewidth=1, label=f"goal at {GOAL_TOKENS} ({GOAL_RATIO}x)"
    )
    ax2.set(ylabel="disaggregated / colocated (p50)", title="TTFT ratio")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set_xlabel("prompt tokens - concurrency")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: tiny preset, short prompts, few requests")
    add("--preset", default="kv-heavy", help="engine preset (default: %(default)s)")
    add("--sizes", type=int, nargs="+", default=None, help=f"prompt tokens (default: {FULL_SIZES})")
    add(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help=f"streams in flight (default: {FULL_CONCURRENCY})",
    )
    add(
        "--workload",
        choices=[w.value for w in Workload],
        default=Workload.SWEEP.value,
        help="sweep: one prompt length per case; mixed: short and long prompts, colocated vs always vs "
        "conditionally disaggregated (default: %(default)s)",
    )
    add(
        "--modes",
        nargs="+",
        choices=[m.value for m in MODES],
        default=None,
        help="transfer modes (default: push and pull; mixed: push, and only the first is used)",
    )
    add("--max-tokens", type=int, default=None, help=f"tokens per answer (default: {MAX_TOKENS}; mixed: 16)")
    add("--requests", type=int, default=None, help="mixed: requests per concurrency and path (default: 40)")
    add("--slo-ttft-ms", type=float, default=None, help="goodput: a good request's TTFT is at most this")
    add("--slo-tpot-ms", type=float, default=None, help="goodput: a good request's TPOT is at most this")
    add(
        "--local-prefill-max-tokens",
        type=int,
        default=None,
        help="mixed: the conditional router's threshold (default: the router's)",
    )
    add("--reps", type=int, default=2, help="requests per case at least (a case runs max(concurrency, reps))")
    add(
        "--max-wave-tokens",
        type=int,
        default=8192,
        help="skip cases whose concurrency x prompt exceeds it; 0: none",
    )
    add("--num-blocks", type=int, default=640, help="KV blocks per engine (kv-heavy: 2 MiB each)")
    add("--seed", type=int, default=0)
    add("--startup-timeout", type=float, default=180.0)
    add("--request-timeout", type=float, default=900.0)
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--plot", metavar="PATH", help="write a PNG plot")


def run(args: argparse.Namespace) -> int:
    mixed = Workload(args.workload) is Workload.MIXED
    doc = e2e_mixed.measure_mixed(args) if mixed else measure(args)
    (e2e_mixed.print_mixed if mixed else print_results)(doc)
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        (e2e_mixed.plot_mixed if mixed else plot)(args.plot, doc)
    mismatched = e2e_mixed.mismatched_total(doc) if mixed else sum(r["mismatched"] for r in doc["cases"])
    if mismatched:
        print(f"e2e: {mismatched} disaggregated answers differ from the colocated ones")
        return 1
    return 0
