"""Helpers shared by the benchmark suites: timing, the JSON envelope, a rich table and a bar plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    try:
        nixl_version: str | None = metadata.version("nixl")
    except metadata.PackageNotFoundError:
        nixl_version = None
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "nixl": nixl_version}


def envelope(suite: str, cases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON document every suite writes: ``{"suite", "cases", "machine"}``."""
    return {"suite": suite, "cases": [dict(c) for c in cases], "machine": machine_info()}


def write_json(path: str | Path, doc: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def median_seconds(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``reps`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row))
    console = Console()
    if not console.is_terminal:  # rich assumes 80 columns when piped, which truncates the figures
        console = Console(width=160)
    console.print(table)


def bar_plot(
    path: str | Path, title: str, labels: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str
) -> None:
    """Grouped bars: one group per label, one bar per series. Written with the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 4.0))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, list(values), width=width, label=name)
    ax.set_xticks(range(len(labels)), list(labels))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each counter of a ``/metrics`` scrape moved between two readings, by key, sorted (keys that
    did not move left out)."""
    out = {k: round(v - before.get(k, 0.0)) for k, v in sorted(after.items())}
    return {k: n for k, n in out.items() if n}
