"""The chaos run's figures: requests by final state, leaked blocks, corruption, time to a terminal state.

``max_end_s`` is the slowest time from a peer's death to a request that was in flight at that moment
reaching its final state; with no such request (no kill landed on one), the slowest request.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvwire_tools.chaos.outcome import Final, RequestRecord, first_difference

SIDES = ("prefill", "decode")
_MAX_SHOWN_ERRORS = 5


@dataclass
class KillEvent:
    """One SIGKILL of a peer and its restart (times are ``time.monotonic()``)."""

    victim: str  # "prefill" or "decode"
    killed_at: float
    restarted_at: float | None = None  # the new process was started
    back_at: float | None = None  # healthy, and the router serves again
    error: str | None = None  # the restart failed

    @property
    def down_s(self) -> float | None:
        return None if self.back_at is None else self.back_at - self.killed_at


def in_flight_at(records: Sequence[RequestRecord], t: float) -> list[RequestRecord]:
    return [r for r in records if r.ran and r.start <= t < r.end]


def max_end_s(records: Sequence[RequestRecord], kills: Sequence[KillEvent]) -> float:
    ends = [r.end - k.killed_at for k in kills for r in in_flight_at(records, k.killed_at)]
    if ends:
        return max(ends)
    return max((r.end - r.start for r in records if r.ran), default=0.0)


def started_while_down(records: Sequence[RequestRecord], kill: KillEvent) -> list[RequestRecord]:
    back = kill.back_at if kill.back_at is not None else float("inf")
    return [r for r in records if r.ran and kill.killed_at <= r.start < back]


def recovered(records: Sequence[RequestRecord], kills: Sequence[KillEvent], i: int) -> bool | None:
    """Whether a request sent after kill ``i``'s peer was back succeeded; None when every such request
    was still running at the next kill (which then decided its fate) or none was sent."""
    back = kills[i].back_at
    if back is None:
        return False
    until = kills[i + 1].killed_at if i + 1 < len(kills) else float("inf")
    window = [r for r in records if r.ran and back <= r.start and r.end <= until]
    if not window:
        return None
    return any(r.final is Final.OK for r in window)


def by_state(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.state for r in records)
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != Final.OK.value, -kv[1], kv[0])))


def summary(
    records: Sequence[RequestRecord], kills: Sequence[KillEvent], leaked: Mapping[str, int | None]
) -> dict[str, Any]:
    """The ``--json`` document: exactly these keys."""
    return {
        "requests": len(records),
        "by_state": by_state(records),
        "leaked_blocks": {side: leaked.get(side) for side in SIDES},
        "corrupted": sum(1 for r in records if r.final is Final.CORRUPTED),
        "max_end_s": round(max_end_s(records, kills), 3),
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def print_report(
    console: Console,
    records: Sequence[RequestRecord],
    kills: Sequence[KillEvent],
    accounts: Mapping[str, Mapping[str, Any] | None],
    data: Mapping[str, Any],
) -> None:
    console.print(_states_table(data))
    if kills:
        console.print(_kills_table(records, kills))
    console.print(_blocks_table(accounts, data))
    console.print(
        f"corrupted: {data['corrupted']}   slowest time from a peer's death to a terminal state: "
        f"{data['max_end_s']:.2f} s"
    )


def _states_table(data: Mapping[str, Any]) -> Table:
    table = Table(title=f"{data['requests']} requests by final state")
    table.add_column("state")
    table.add_column("requests", justify="right")
    for state, n in data["by_state"].items():
        table.add_row(state, str(n))
    return table


def _kills_table(records: Sequence[RequestRecord], kills: Sequence[KillEvent]) -> Table:
    t0 = min((r.start for r in records if r.ran), default=kills[0].killed_at)
    table = Table(title="kills (SIGKILL, then restart on the same ports)")
    for col in (
        "victim",
        "at s",
        "down s",
        "in flight",
        "their end s",
        "sent while down",
        "slowest answer s",
    ):
        table.add_column(col, justify="right")
    table.add_column("recovered")
    for i, k in enumerate(kills):
        hit = in_flight_at(records, k.killed_at)
        down = started_while_down(records, k)
        rec = recovered(records, kills, i)
        table.add_row(
            k.victim,
            f"{k.killed_at - t0:.1f}",
            f"{k.down_s:.1f}" if k.down_s is not None else (k.error or "never back"),
            str(len(hit)),
            f"{max(r.end - k.killed_at for r in hit):.2f}" if hit else "-",
            str(len(down)),
            f"{max(r.end - r.start for r in down):.2f}" if down else "-",
            "-" if rec is None else ("yes" if rec else "NO"),
        )
    return table


def _blocks_table(accounts: Mapping[str, Mapping[str, Any] | None], data: Mapping[str, Any]) -> Table:
    table = Table(title="KV blocks once quiet")
    for col in ("side", "total", "free", "leaked", "quarantined", "held", "fenced", "live requests"):
        table.add_column(col, justify="right")
    for side in SIDES:
        acc = accounts.get(side)
        leaked = data["leaked_blocks"][side]
        if acc is None:
            table.add_row(side, "?", "?", "unknown (no answer)", "", "", "", "")
            continue
        b, r = acc["blocks"], acc["requests"]
        table.add_row(
            side, str(b["total"]), str(b["free"]), str(leaked), str(b["quarantined"]), str(b["held"]),
            str(b["fenced"]), str(r["live"]),
        )  # fmt: skip
    return table


def problems(
    records: Sequence[RequestRecord],
    kills: Sequence[KillEvent],
    leaked: Mapping[str, int | None],
    references: Sequence[Sequence[int]],
) -> list[str]:
    """Why the run fails (empty: it passed): leaks, corruption, a peer not back, no recovery, no time."""
    out = [f"{side}: {n} KV blocks leaked" for side, n in leaked.items() if n]
    out += [f"{side}: no block accounting (engine not answering)" for side, n in leaked.items() if n is None]
    bad = [r for r in records if r.final is Final.CORRUPTED]
    if bad:
        out.append(f"{len(bad)} requests corrupted (wrong tokens)")
    for r in bad[:_MAX_SHOWN_ERRORS]:
        out.append(
            f"request {r.index} ({r.detail}): {first_difference(r.token_ids, references[r.prompt_id])}"
        )
    out += [f"kill of {k.victim}: {k.error}" for k in kills if k.error]
    for i, k in enumerate(kills):
        if recovered(records, kills, i) is False:
            out.append(f"no request succeeded after {k.victim} came back (kill {i + 1})")
    not_run = sum(1 for r in records if not r.ran)
    if not_run:
        out.append(f"{not_run} requests never started: the run hit its deadline")
    return out
