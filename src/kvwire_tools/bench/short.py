"""``kvwire bench short``: a short request (a 40-character prompt, ``max_tokens`` 1, one at a time)
disaggregated through the router against colocated, where the difference goes, and idle engines' CPU.

The bench starts its own servers on 127.0.0.1 (``bench.e2e.start_cluster``: a colocated engine, a push
P and D, a router) and sends requests one at a time, alternating colocated and disaggregated so both see
the same machine. TTFT is timed at the client. Each disaggregated request's steps come from the engines'
timelines (``/v1/kv_stats?timeline=N``; one monotonic clock for every process of the host), lined up
with the client's send time: the breakdown is the median of each step over the requests.

Two more figures:

* ``disaggregated_after_idle``: the same request after ``--pause-s`` of silence (engines backed off to
  their idle polling): what idling costs the next request, beside ``disaggregated``.
* ``cpu_ms_per_request``: CPU of each server process (``/proc``) over the alternating phase, divided by
  the requests of its path (router, P and D: the disaggregated ones; the colocated engine: its own): on a
  small host this CPU is latency, since every process of a request shares the cores.
* ``idle``: CPU of each engine process (``/proc/PID/stat`` utime + stime) over ``--idle-s`` with no
  request, from ``--settle-s`` after the last one (a connector polls at its ready rate for
  ``ACTIVE_GRACE_S`` after traffic), in % of one core; ``--compare PATH`` prints a previous run's figures
  beside this run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvwire.connector.timeline import Stage
from kvwire.protocol.messages import TransferMode
from kvwire.testing.procs import Server, ServerGroup, server_env
from kvwire_tools.bench.common import bar_plot, envelope, print_table, write_json
from kvwire_tools.bench.e2e import Cluster, start_cluster
from kvwire_tools.demo.report import percentile
from kvwire_tools.demo.workload import stream_completion

PROMPT = "the quick brown fox jumps over a lazy dog"[:40]
GOAL_GAP_MS = 3.0
_WARMUP = 10
_Marks = Mapping[str, float]
# (name, from, to): a disaggregated request's steps, each from one mark to the next on its path. Marks are
# "client", "p.<stage>" or "d.<stage>"; "client" is the send, "client_first" the first token at the client.
_DISAGG_STEPS: tuple[tuple[str, str, str], ...] = (
    ("router -> D arrival", "client", "d.arrived"),
    ("router -> P arrival", "client", "p.arrived"),
    ("D arrival -> KV allocated", "d.arrived", "d.kv_allocated"),
    ("D alloc -> connector loop", "d.kv_allocated", "d.loop_received"),
    ("D loop -> push_reg sent", "d.loop_received", "d.push_reg_sent"),
    ("push_reg in flight", "d.push_reg_sent", "p.push_reg_received"),
    ("P arrival -> prefill done", "p.arrived", "p.prefill_done"),
    ("P prefill -> connector loop", "p.prefill_done", "p.loop_received"),
    ("P ready -> write posted", "p.ready", "p.write_posted"),
    ("write + done in flight", "p.write_posted", "d.done_received"),
    ("(P: write posted -> P sees it done)", "p.write_posted", "p.write_done"),
    ("D done -> engine has KV", "d.done_received", "d.kv_ready"),
    ("D first step", "d.kv_ready", "d.first_token"),
    ("D token -> answer", "d.first_token", "d.answered"),
    ("D answer -> client", "d.answered", "client_first"),
)
_COLOC_STEPS: tuple[tuple[str, str, str], ...] = (
    ("client -> engine arrival", "client", "c.arrived"),
    ("engine arrival -> first token", "c.arrived", "c.first_token"),
    ("token -> answer", "c.first_token", "c.answered"),
    ("answer -> client", "c.answered", "client_first"),
)


# -- requests -----------------------------------------------------------------------------------------------
def one_request(client: httpx.Client, url: str, model: str, timeout_s: float) -> tuple[float, float, int]:
    """(send time, first-token time at the client, token id) of one streamed ``max_tokens`` 1 request."""
    sent = time.monotonic()
    result = stream_completion(client, url, model, PROMPT, 1, timeout_s)
    return sent, sent + result.ttft_s, result.token_ids[0] if result.token_ids else -1


def _timeline(client: httpx.Client, url: str, last: int) -> dict[str, dict[str, Any]]:
    rows = client.get(url + "/v1/kv_stats", params={"timeline": last}).json().get("timeline", [])
    return {str(r["id"]): r for r in rows}


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    def pick(q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v * 1e3

    return {"p50": pick(50), "p99": pick(99)}


def _ready(p: Mapping[str, Any]) -> float | None:
    """When P could write: its loop has the finished request AND the push_reg (the later of the two)."""
    xs = [x for x in (p.get(Stage.LOOP_RECEIVED.value), p.get(Stage.PUSH_REG_RECEIVED.value)) if x]
    return max(xs) if xs else None


def _disagg_marks(sent: float, first: float, p: Mapping[str, Any], d: Mapping[str, Any]) -> dict[str, float]:
    marks: dict[str, float] = {"client": sent, "client_first": first}
    for prefix, row in (("p", p), ("d", d)):
        for stage in Stage:
            if isinstance(row.get(stage.value), float):
                marks[f"{prefix}.{stage.value}"] = row[stage.value]
    ready = _ready(p)
    if ready is not None:
        marks["p.ready"] = ready
    return marks


def _steps(records: Sequence[_Marks], steps: Sequence[tuple[str, str, str]]) -> dict[str, float | None]:
    """Median milliseconds of each step over the requests that have both its marks."""
    out: dict[str, float | None] = {}
    for name, a, b in steps:
        spans = [r[b] - r[a] for r in records if a in r and b in r]
        out[name] = statistics.median(spans) * 1e3 if spans else None
    return out


# -- the run ------------------------------------------------------------------------------------------------
class Short:
    """The servers of one run and the client that drives them."""

    def __init__(self, client: httpx.Client, cluster: Cluster, model: str, timeout_s: float) -> None:
        self.client, self.cluster, self.model, self.timeout_s = client, cluster, model, timeout_s
        self.p, self.d, self.router = cluster.disagg[TransferMode.PUSH]

    def pids(self) -> dict[str, int]:
        servers = {"router": self.router, "prefill": self.p, "decode": self.d}
        return pids_of({**servers, "colocated": self.cluster.colocated})

    def send(self, url: str) -> tuple[float, float, int]:
        return one_request(self.client, url, self.model, self.timeout_s)

    def alternate(self, n: int) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
        coloc, disagg = [], []
        for _ in range(n):
            coloc.append(self.send(self.cluster.colocated.url))
            disagg.append(self.send(self.router.url))
        return coloc, disagg

    def after_idle(self, n: int, pause_s: float) -> list[tuple[float, float, int]]:
        out = []
        for _ in range(n):
            time.sleep(pause_s)
            out.append(self.send(self.router.url))
        return out

    def disagg_records(self, sends: Sequence[tuple[float, float, int]]) -> list[dict[str, float]]:
        """Each request's marks, matched to P's and D's timelines by send order (one request at a time:
        the k-th transfer each engine saw after the warm-up is the k-th request)."""
        last = len(sends)
        p_rows = list(_timeline(self.client, self.p.url, last).values())
        d_rows = list(_timeline(self.client, self.d.url, last).values())
        by_id = {r["id"]: r for r in p_rows}
        out = []
        for (sent, first, _), d in zip(sends, d_rows[-last:], strict=False):
            out.append(_disagg_marks(sent, first, by_id.get(d["id"], {}), d))
        return out

    def coloc_records(self, sends: Sequence[tuple[float, float, int]]) -> list[dict[str, float]]:
        rows = list(_timeline(self.client, self.cluster.colocated.url, len(sends)).values())
        out = []
        for (sent, first, _), row in zip(sends, rows[-len(sends) :], strict=False):
            marks = {"client": sent, "client_first": first}
            marks.update({f"c.{k}": v for k, v in row.items() if isinstance(v, float)})
            out.append(marks)
        return out


def pids_of(servers: Mapping[str, Server]) -> dict[str, int]:
    """Each running server's process id, by name."""
    return {name: s.proc.pid for name, s in servers.items() if s.proc is not None}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(servers: Mapping[str, Server], seconds: float) -> dict[str, float]:
    """% of one core each server process used over ``seconds`` with no request."""
    pids = pids_of(servers)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {name: (cpu_seconds(pid) - before[name]) / wall * 100 for name, pid in pids.items()}


def _case(path: str, sends: Sequence[tuple[float, float, int]]) -> dict[str, Any]:
    ttft = _ms([first - sent for sent, first, _ in sends])
    return {"path": path, "requests": len(sends), "p50_ms": ttft["p50"], "p99_ms": ttft["p99"]}


def cpu_per_request(
    before: Mapping[str, float], after: Mapping[str, float], requests: int
) -> dict[str, float]:
    """Milliseconds of CPU per request of each process, from two ``cpu_seconds`` snapshots."""
    return {name: (after[name] - before[name]) / max(requests, 1) * 1e3 for name in before}


def _measure_requests(short: Short, args: argparse.Namespace) -> dict[str, Any]:
    for _ in range(_WARMUP):  # lazy imports, first allocations, the handshakes: not counted
        short.alternate(1)
    pids = short.pids()
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    coloc, disagg = short.alternate(args.requests)
    cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    coloc_rec, disagg_rec = short.coloc_records(coloc), short.disagg_records(disagg)
    idle = short.after_idle(args.after_idle_requests, args.pause_s)
    cases = [
        _case("colocated", coloc),
        _case("disaggregated", disagg),
        _case("disaggregated_after_idle", idle),
    ]
    mismatched = sum(a[2] != b[2] for a, b in zip(coloc, disagg, strict=True))
    return {
        "cases": cases,
        "breakdown": {
            "disaggregated": _steps(disagg_rec, _DISAGG_STEPS),
            "colocated": _steps(coloc_rec, _COLOC_STEPS),
        },
        "mismatched": mismatched,
        # Each process serves one path (the other path's requests cost it only its idle polling).
        "cpu_ms_per_request": cpu_per_request(cpu_before, cpu_after, args.requests),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="kvwire-bench-short-"))
    ok = False
    try:
        with ServerGroup(log_dir, server_env()) as group:
            cluster = start_cluster(group, "tiny", None, [TransferMode.PUSH], args.startup_timeout)
            with httpx.Client(timeout=args.request_timeout) as client:
                model = str(client.get(cluster.colocated.url + "/health").json().get("model") or "kvwire")
                short = Short(client, cluster, model, args.request_timeout)
                result = _measure_requests(short, args)
                p, d, _router = cluster.disagg[TransferMode.PUSH]
                servers = {"prefill": p, "decode": d, "colocated": cluster.colocated}
                time.sleep(args.settle_s)  # the connectors stay ready for a while after traffic
                result["idle_cpu_pct"] = idle_cpu(servers, args.idle_s) if args.idle_s > 0 else {}
            group.check_all_alive()
        ok = True
    finally:
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"short: server logs kept in {log_dir}", flush=True)
    doc = envelope("short", result.pop("cases"))
    doc.update(result)
    by = {c["path"]: c for c in doc["cases"]}
    gap = _gap(by["disaggregated"]["p50_ms"], by["colocated"]["p50_ms"])
    doc["gap_p50_ms"] = gap
    doc["goal_gap_p50_ms"] = GOAL_GAP_MS
    doc["goal_met"] = gap is not None and gap <= GOAL_GAP_MS
    doc["config"] = {"prompt": PROMPT, "max_tokens": 1, "pause_s": args.pause_s, "idle_s": args.idle_s}
    return doc


def _gap(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


# -- output -------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> Any:
    return "-" if v is None else v


def print_results(doc: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> None:
    """This run's figures; with ``before`` (a previous run's JSON), its figures beside them."""

    def prev(path: str) -> Mapping[str, Any]:
        return next((c for c in (before or {}).get("cases", []) if c["path"] == path), {})

    rows = [
        (c["path"], c["requests"], c["p50_ms"], c["p99_ms"], _fmt(prev(c["path"]).get("p50_ms")),
         _fmt(prev(c["path"]).get("p99_ms")))
        for c in doc["cases"]
    ]  # fmt: skip
    print_table("short request TTFT (ms): this run | before", ("path", "reqs", "p50", "p99", "p50 before",
                "p99 before"), rows)  # fmt: skip
    print(f"disaggregated - colocated p50: {_fmt(doc['gap_p50_ms'])} ms (goal <= {GOAL_GAP_MS} ms)")
    for path, steps in doc["breakdown"].items():
        old = (before or {}).get("breakdown", {}).get(path, {})
        step_rows = [(name, _fmt(ms), _fmt(old.get(name))) for name, ms in steps.items()]
        print_table(f"{path}: median ms per step", ("step", "ms", "before"), step_rows)
    old_cpu = (before or {}).get("cpu_ms_per_request", {})
    cpu_rows = [(name, ms, _fmt(old_cpu.get(name))) for name, ms in doc.get("cpu_ms_per_request", {}).items()]
    print_table("CPU per request (ms, each process on its own path)", ("process", "ms", "before"), cpu_rows)
    old_idle = (before or {}).get("idle_cpu_pct", {})
    idle_rows = [(name, pct, _fmt(old_idle.get(name))) for name, pct in doc["idle_cpu_pct"].items()]
    print_table("idle CPU (% of one core)", ("engine", "now", "before"), idle_rows)


def plot(path: str, doc: Mapping[str, Any], before: Mapping[str, Any] | None) -> None:
    """TTFT p50 per path and idle CPU per engine, this run beside ``before`` (when given)."""
    runs = {"before": before, "this run": doc} if before is not None else {"this run": doc}
    names = {
        "colocated": "coloc",
        "disaggregated": "disagg",
        "disaggregated_after_idle": "disagg\nafter idle",
    }
    labels = [names.get(c["path"], c["path"]) for c in doc["cases"]]
    labels += [f"idle {e}\n(% core x10)" for e in doc["idle_cpu_pct"]]

    def values(run: Mapping[str, Any]) -> list[float]:
        by = {c["path"]: c["p50_ms"] or 0.0 for c in run.get("cases", [])}
        idle = run.get("idle_cpu_pct", {})
        return [by.get(c["path"], 0.0) for c in doc["cases"]] + [
            10 * idle.get(e, 0.0) for e in doc["idle_cpu_pct"]
        ]

    series = {name: values(run) for name, run in runs.items() if run is not None}
    bar_plot(path, "short request: TTFT p50 (ms) and idle CPU", labels, series, "ms / (% of a core x10)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--requests", type=int, default=100, help="requests per path, one at a time")
    add("--after-idle-requests", type=int, default=20, help="disaggregated requests each after a pause")
    add("--pause-s", type=float, default=0.5, help="silence before each after-idle request")
    add("--idle-s", type=float, default=10.0, help="idle CPU measured over this long; 0: skip")
    add("--settle-s", type=float, default=3.0, help="wait after the last request before measuring idle CPU")
    add("--startup-timeout", type=float, default=120.0)
    add("--request-timeout", type=float, default=30.0)
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--compare", metavar="PATH", help="a previous run's JSON, printed beside this run")
    add("--plot", metavar="PATH", help="write a PNG plot (this run beside --compare's)")


def run(args: argparse.Namespace) -> int:
    doc = measure(args)
    before = json.loads(Path(args.compare).read_text()) if args.compare else None
    print_results(doc, before)
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot(args.plot, doc, before)
    if doc["mismatched"]:
        print(f"short: {doc['mismatched']} disaggregated answers differ from the colocated ones")
        return 1
    return 0
