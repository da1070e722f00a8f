"""What ``kvwire bench flood`` prints and plots from its JSON document (``bench/flood.py`` measures it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwire_tools.bench.common import bar_plot, print_table


def _fmt(v: Any) -> Any:
    return "-" if v is None else v


def print_results(doc: Mapping[str, Any]) -> None:
    rows = [
        (c["mode"], c["phase"], c["requests"], c["failed"], c["wrong"], _fmt(c["p50_ms"]), _fmt(c["p99_ms"]),
         _fmt(c["rss_mb"]), _fmt(c["p50_x_baseline"]), _fmt(c["p99_x_baseline"]), _fmt(c["rss_x_baseline"]))
        for c in doc["cases"]
    ]  # fmt: skip
    print_table(
        "flood: real requests through the router while a rogue peer floods P (during: P's peak RSS)",
        ("mode", "phase", "reqs", "failed", "wrong", "p50 ms", "p99 ms", "P RSS MB", "p50 x base",
         "p99 x base", "RSS x base"),
        rows,
    )  # fmt: skip
    drop_rows = []
    for mode, m in doc["modes"].items():
        sent = m["sent"]
        flood = (
            f"{sent['push_regs']} push_regs, {sent['heartbeats']} heartbeats ({sent['heartbeat_ids']} ids)"
        )
        drops = ", ".join(f"{r} {n}" for r, n in m["drops"].items()) or "none"
        ended = ", ".join(f"{r} {n}" for r, n in m["p_failures"].items()) or "none"
        held = f"{m['settle_s']:.1f}" + ("" if m["settled"] else " (timeout)")
        drop_rows.append(
            (mode, flood, drops, ended, held, m["listener_connections"], _fmt(m["rss_growth_mb"]))
        )
    print_table(
        "flood: what P did with it (kvwire_dropped_notifications and kvwire_failures from P's /metrics)",
        ("mode", "sent", "dropped by reason", "registrations ended", "held s", "P dialled", "RSS +MB"),
        drop_rows,
    )
    for mode, m in doc["modes"].items():
        print(f"{mode}: the rogue got P's metadata from {m['metadata_source']}; an unsigned get_metadata "
              f"gets {m['outsider_fetch']}")  # fmt: skip
    print(
        "held s: after the flood phase, until P had ended the registrations the flood made; P dialled: "
        "connections the bench's listener (named in every push_reg) received"
    )


def plot(path: str, doc: Mapping[str, Any]) -> None:
    labels = [f"{c['mode']}\n{c['phase']}" for c in doc["cases"]]
    series = {
        "p50 ms": [c["p50_ms"] or 0.0 for c in doc["cases"]],
        "p99 ms": [c["p99_ms"] or 0.0 for c in doc["cases"]],
        "P RSS MB": [c["rss_mb"] or 0.0 for c in doc["cases"]],
    }
    bar_plot(path, "flood: latency and P's RSS per phase", labels, series, "ms / MB")
