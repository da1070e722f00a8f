"""What the demo reports: engine KV stats, the summary (``--json``), the table and the plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from kvwire_tools.demo.workload import Result


@dataclass
class EngineStats:
    """The engines' KV transfer totals and handshakes (each transfer counted once, by its poster)."""

    transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    handshakes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gbps(self) -> float | None:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else None


def collect_engine_stats(client: httpx.Client, engines: Sequence[tuple[str, str]]) -> EngineStats:
    """``engines``: (name, url). Reads ``/v1/kv_stats``; falls back to ``/metrics`` where it is missing."""
    stats = EngineStats()
    for name, url in engines:
        resp = client.get(url + "/v1/kv_stats")
        if resp.status_code == 200:
            _add_snapshot(stats, name, resp.json())
        else:
            _add_prometheus(stats, name, client.get(url + "/metrics").text)
    return stats


def _add_snapshot(stats: EngineStats, name: str, snap: dict[str, Any]) -> None:
    stats.transfers += int(snap.get("transfers", 0))
    stats.num_bytes += int(snap.get("bytes", 0))
    stats.seconds += float(snap.get("transfer_seconds", 0.0))
    for h in snap.get("handshakes", []):
        # Engines name both ends ("P pp0/tp0 -> D"); prefix the reporter only when they do not.
        peer = str(h["peer"]) if "->" in str(h["peer"]) else f"{name} -> {h['peer']}"
        stats.handshakes.append({"peer": peer, "notif_only": bool(h["notif_only"]), "ms": float(h["ms"])})


def _add_prometheus(stats: EngineStats, name: str, text: str) -> None:
    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            mode = sample.labels.get("mode", "")
            sums[(sample.name, mode)] = sums.get((sample.name, mode), 0.0) + sample.value
    for (metric, _mode), value in sums.items():
        if metric == "kvwire_transfer_bytes_total":
            stats.num_bytes += int(value)
        elif metric == "kvwire_transfer_seconds_sum":
            stats.seconds += value
        elif metric == "kvwire_transfer_seconds_count":
            stats.transfers += int(value)
    for mode in ("notif_only", "full"):
        count = sums.get(("kvwire_handshake_seconds_count", mode), 0.0)
        if count:
            mean_ms = sums.get(("kvwire_handshake_seconds_sum", mode), 0.0) / count * 1e3
            peer = f"{name} (mean of {int(count)})"
            stats.handshakes.append({"peer": peer, "notif_only": mode == "notif_only", "ms": mean_ms})


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _ms_pair(values: Sequence[float]) -> dict[str, float | None]:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {"p50": None if p50 is None else p50 * 1e3, "p99": None if p99 is None else p99 * 1e3}


def summary(
    mode: str,
    disagg: Sequence[Result | None],
    coloc: Sequence[Result | None],
    matched: int,
    stats: EngineStats,
) -> dict[str, Any]:
    """The ``--json`` object, exactly the shape of issue 5."""
    return {
        "requests": len(disagg),
        "matched": matched,
        "mode": mode,
        "ttft_ms": _ms_pair([r.ttft_s for r in disagg if r is not None]),
        "colocated_ttft_ms": _ms_pair([r.ttft_s for r in coloc if r is not None]),
        "transfer_gbps": stats.gbps,
        "handshakes": stats.handshakes,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(
    console: Console, data: dict[str, Any], disagg: Sequence[Result | None], coloc: Sequence[Result | None],
    stats: EngineStats,
) -> None:  # fmt: skip
    tpot_d = _ms_pair([t for r in disagg if r is not None and (t := r.tpot_s) is not None])
    tpot_c = _ms_pair([t for r in coloc if r is not None and (t := r.tpot_s) is not None])
    table = Table(title=f"kvwire demo: {data['matched']}/{data['requests']} matched ({data['mode']} mode)")
    table.add_column("metric")
    table.add_column("disaggregated", justify="right")
    table.add_column("colocated", justify="right")
    for q in ("p50", "p99"):
        table.add_row(f"TTFT {q} (ms)", _fmt(data["ttft_ms"][q]), _fmt(data["colocated_ttft_ms"][q]))
    for q in ("p50", "p99"):
        table.add_row(f"TPOT {q} (ms)", _fmt(tpot_d[q], 2), _fmt(tpot_c[q], 2))
    table.add_row("matched", f"{data['matched']}/{data['requests']}", "reference")
    moved = f"{_fmt(stats.gbps, 2)} GB/s ({stats.transfers} transfers, {stats.num_bytes / 2**20:.1f} MiB)"
    table.add_row("KV transfer", moved, "-")
    console.print(table)
    if stats.handshakes:
        hs = Table(title="handshakes")
        hs.add_column("peer")
        hs.add_column("mode")
        hs.add_column("ms", justify="right")
        for h in stats.handshakes:
            hs.add_row(h["peer"], "notif-only" if h["notif_only"] else "full", _fmt(h["ms"], 2))
        console.print(hs)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_plot(
    path: Path, disagg: Sequence[Result | None], coloc: Sequence[Result | None], data: dict[str, Any]
) -> None:
    """TTFT and TPOT against prompt length, disaggregated vs colocated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for results, label, marker in ((disagg, "disaggregated", "o"), (coloc, "colocated", "x")):
        done = [r for r in results if r is not None]
        ax1.scatter(
            [r.prompt_tokens for r in done], [r.ttft_s * 1e3 for r in done], label=label, marker=marker
        )
        tp = [(r.prompt_tokens, r.tpot_s * 1e3) for r in done if r.tpot_s is not None]
        ax2.scatter([x for x, _ in tp], [y for _, y in tp], label=label, marker=marker)
    ax1.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="time to first token")
    ax2.set(xlabel="prompt tokens", ylabel="TPOT (ms)", title="time per output token")
    for ax in (ax1, ax2):
        ax.set_xscale("log")  # prompt lengths are spread geometrically
        ax.grid(alpha=0.3)
        ax.legend()
    gbps = data.get("transfer_gbps")
    fig.suptitle(
        f"kvwire demo ({data['mode']}): {data['matched']}/{data['requests']} matched, "
        f"KV transfer {_fmt(gbps, 2)} GB/s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
