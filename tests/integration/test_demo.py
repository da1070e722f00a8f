"""``kvwire demo`` end to end: real engine servers, real NIXL, the router, as separate processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

_DEMO_TIMEOUT_S = 180


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _server_pids(log_dir: Path) -> list[int]:
    index = log_dir / "servers.json"
    return [int(s["pid"]) for s in json.loads(index.read_text())] if index.exists() else []


def run_demo(tmp_path: Path, *args: str) -> tuple[int, str, list[int]]:
    """Run the demo; whatever happens, no server it started outlives the test."""
    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "kvwire.cli", "demo", "--log-dir", str(log_dir), *args]
    env = {**os.environ, "UCX_MODULES": "^ib*", "COLUMNS": "120"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        out, _ = proc.communicate(timeout=_DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops its servers on SIGTERM
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pids = _server_pids(log_dir)
        leaked = [pid for pid in pids if _alive(pid)]
        for pid in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert not leaked, f"servers left running: {leaked}"
    return proc.returncode, out.decode(errors="replace"), pids


def test_demo_small_run_matches_colocated(tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "demo.json", tmp_path / "demo.png"
    rc, out, pids = run_demo(
        tmp_path, "--requests", "4", "--min-prompt-tokens", "8", "--max-prompt-tokens", "200",
        "--max-tokens", "6", "--json", str(json_path), "--plot", str(png_path),
    )  # fmt: skip
    assert rc == 0, out
    assert "4/4 matched" in out
    assert len(pids) == 4  # prefill, decode, colocated, router
    data = json.loads(json_path.read_text())
    assert set(data) == {"requests", "matched", "mode", "ttft_ms", "colocated_ttft_ms", "transfer_gbps",
                         "handshakes"}  # fmt: skip
    assert (data["requests"], data["matched"], data["mode"]) == (4, 4, "push")
    assert 0 < data["ttft_ms"]["p50"] <= data["ttft_ms"]["p99"]
    assert 0 < data["colocated_ttft_ms"]["p50"] <= data["colocated_ttft_ms"]["p99"]
    assert data["transfer_gbps"] > 0
    # Push mode: D's handshake with P is notif-only, P's with D is full.
    assert {h["notif_only"] for h in data["handshakes"]} == {True, False}
    assert all(h["ms"] > 0 and h["peer"] for h in data["handshakes"])
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_cleanly_when_a_server_cannot_start(tmp_path: Path) -> None:
    rc, out, pids = run_demo(tmp_path, "--requests", "1", "--preset", "no-such-preset", "--no-files")
    assert rc != 0
    assert "demo failed" in out
    assert pids  # it did start servers, and run_demo checked that none is left
