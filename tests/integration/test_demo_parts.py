"""The demo's pieces: prompts, statistics, the report files, and process cleanup."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvwire.metrics import HandshakeStats, KvMetrics, TransferStats
from kvwire.protocol.messages import TransferMode
from kvwire.testing.procs import ServerFailed, ServerGroup, free_port
from kvwire.transport.base import PeerMode
from kvwire_tools.demo import report
from kvwire_tools.demo.workload import Result, make_prompts, prompt_lengths


def test_prompts_are_deterministic_and_span_the_range() -> None:
    lengths = prompt_lengths(32, 16, 2048, seed=3)
    assert min(lengths) == 16 and max(lengths) == 2048 and len(lengths) == 32
    assert lengths == prompt_lengths(32, 16, 2048, seed=3)
    assert lengths != prompt_lengths(32, 16, 2048, seed=4)
    prompts = make_prompts(32, 16, 2048, seed=3)
    assert prompts == make_prompts(32, 16, 2048, seed=3)
    # One BOS plus one token per ASCII byte: exactly the planned length.
    assert [len(p.encode()) + 1 for p in prompts] == lengths
    assert all(p.isascii() for p in prompts)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 50) == 50.0
    assert report.percentile(values, 99) == 99.0
    assert report.percentile([3.0], 99) == 3.0
    assert report.percentile([], 50) is None


def _results(n: int, ttft_s: float) -> list[Result | None]:
    return [Result(prompt_tokens=10 * (i + 1), token_ids=[1, 2, 3], ttft_s=ttft_s, total_s=ttft_s + 0.02)
            for i in range(n)]  # fmt: skip


def test_summary_has_exactly_the_issue_shape(tmp_path: Path) -> None:
    stats = report.EngineStats(transfers=2, num_bytes=2_000_000, seconds=0.001)
    stats.handshakes.append({"peer": "decode0 -> P", "notif_only": True, "ms": 3.5})
    data = report.summary("push", _results(4, 0.010), _results(4, 0.008), 4, stats)
    assert set(data) == {"requests", "matched", "mode", "ttft_ms", "colocated_ttft_ms", "transfer_gbps",
                         "handshakes"}  # fmt: skip
    assert data["requests"] == 4 and data["matched"] == 4 and data["mode"] == "push"
    assert data["ttft_ms"] == {"p50": pytest.approx(10.0), "p99": pytest.approx(10.0)}
    assert data["colocated_ttft_ms"]["p50"] == pytest.approx(8.0)
    assert data["transfer_gbps"] == pytest.approx(2.0)
    assert data["handshakes"] == [{"peer": "decode0 -> P", "notif_only": True, "ms": 3.5}]
    report.write_json(tmp_path / "d.json", data)
    assert json.loads((tmp_path / "d.json").read_text()) == data
    report.write_plot(tmp_path / "d.png", _results(4, 0.010), _results(4, 0.008), data)
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    console = Console(record=True, width=120)
    report.print_table(console, data, _results(4, 0.010), _results(4, 0.008), stats)
    text = console.export_text()
    assert "4/4 matched" in text and "2.00 GB/s" in text and "notif-only" in text


def test_engine_stats_from_kv_stats_and_from_prometheus_agree() -> None:
    m = KvMetrics()
    m.record_transfer(TransferStats(TransferMode.PUSH, num_bytes=3_000_000, seconds=0.002))
    m.record_handshake(HandshakeStats("D", PeerMode.FULL, 0.05))
    a, b = report.EngineStats(), report.EngineStats()
    report._add_snapshot(a, "prefill0", m.snapshot())
    report._add_prometheus(b, "prefill0", m.render().decode())
    assert (a.transfers, a.num_bytes) == (b.transfers, b.num_bytes) == (1, 3_000_000)
    assert a.gbps == pytest.approx(b.gbps) == pytest.approx(1.5)
    assert a.handshakes == [{"peer": "prefill0 -> D", "notif_only": False, "ms": pytest.approx(50.0)}]
    assert b.handshakes[0]["notif_only"] is False and b.handshakes[0]["ms"] == pytest.approx(50.0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_server_group_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    stubborn = (
        f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w')"
    )
    stubborn += "; time.sleep(60)"
    with ServerGroup(tmp_path) as group:
        server = group.start_argv("stubborn", [sys.executable, "-c", stubborn], free_port())
        polite = group.start_argv(
            "polite", [sys.executable, "-c", "import time; time.sleep(60)"], free_port()
        )
        assert server.proc is not None and polite.proc is not None
        with pytest.raises(ServerFailed, match="not healthy"):
            group.wait_healthy([server], timeout_s=0.3)
        for _ in range(500):  # SIGTERM must reach it only once it ignores SIGTERM
            if ready.exists():
                break
            time.sleep(0.02)
        killed = group.stop_all(timeout_s=1.0)
    assert killed == ["stubborn"]
    assert _gone(server.proc.pid) and _gone(polite.proc.pid)
    index = json.loads((tmp_path / "servers.json").read_text())
    assert [s["name"] for s in index] == ["stubborn", "polite"]


def test_server_group_reports_a_server_that_exits(tmp_path: Path) -> None:
    with ServerGroup(tmp_path) as group:
        server = group.start_argv(
            "crash", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], free_port()
        )
        with pytest.raises(ServerFailed, match=r"(?s)exited with status 3.*boom"):
            group.wait_healthy([server], timeout_s=30)
