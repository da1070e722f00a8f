"""``kvwire chaos``: a small run with real processes and NIXL (P and D each SIGKILLed and restarted once),
plus the pure parts (kill plan, judging tokens, figures, what fails a run)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import cast

import pytest

from kvwire.errors import ConfigError
from kvwire.testing.procs import ServerGroup
from kvwire_tools.chaos.outcome import Final, RequestRecord, judge
from kvwire_tools.chaos.plan import ChaosConfig, PlannedKill, Victim, plan_kills
from kvwire_tools.chaos.report import KillEvent, by_state, max_end_s, problems, recovered, summary
from kvwire_tools.chaos.runner import ChaosRun, Cluster

_RUN_TIMEOUT_S = 150


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _run_chaos(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run ``kvwire chaos``; whatever happens, no server it started outlives the test."""
    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "kvwire.cli", "chaos", "--log-dir", str(log_dir), *args]
    env = {**os.environ, "UCX_MODULES": "^ib*", "COLUMNS": "160"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        out, _ = proc.communicate(timeout=_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        index = log_dir / "servers.json"
        pids = [int(s["pid"]) for s in json.loads(index.read_text())] if index.exists() else []
        leaked = [pid for pid in pids if _alive(pid)]
        for pid in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert not leaked, f"servers left running: {leaked}"
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.nixl
@pytest.mark.slow  # kills and restarts engine servers: ~18 s
def test_small_chaos_run_leaks_nothing_and_corrupts_nothing(tmp_path: Path) -> None:
    json_path = tmp_path / "chaos.json"
    rc, out = _run_chaos(
        tmp_path, "--requests", "40", "--kills", "3", "--seed", "3", "--kv-lease-s", "5",
        "--quiet-timeout", "30", "--json", str(json_path),
    )  # fmt: skip
    assert rc == 0, out
    data = json.loads(json_path.read_text())
    assert set(data) == {"requests", "by_state", "leaked_blocks", "corrupted", "max_end_s"}
    assert data["requests"] == 40 and sum(data["by_state"].values()) == 40
    assert data["leaked_blocks"] == {"prefill": 0, "decode": 0}
    assert data["corrupted"] == 0 and "corrupted" not in data["by_state"]
    assert data["by_state"].get("ok", 0) > 0
    # Each peer was down for a while and requests were sent meanwhile: some ended with an error.
    assert sum(n for s, n in data["by_state"].items() if s != "ok") > 0
    assert "not_run" not in data["by_state"]
    assert 0 < data["max_end_s"] < 30
    assert "killed prefill" in out and "killed decode" in out
    assert out.count("serving again") == 3


# -- the pure parts ---------------------------------------------------------------------------------------


def test_kill_plan_is_seeded_alternates_victims_and_stays_inside_the_run() -> None:
    cfg = ChaosConfig(requests=200, kills=5, seed=7)
    plan = plan_kills(cfg)
    assert plan == plan_kills(cfg)
    assert [k.victim for k in plan[::2]] == [plan[0].victim] * 3
    assert {k.victim for k in plan[1::2]} == {Victim.PREFILL, Victim.DECODE} - {plan[0].victim}
    moments = [k.after_started for k in plan]
    assert moments == sorted(moments) and moments[0] >= 20 and moments[-1] <= 150
    assert all(cfg.min_down_s <= k.down_s <= cfg.max_down_s for k in plan)
    assert {k.victim for k in plan_kills(ChaosConfig(requests=40, kills=2, seed=1))} == set(Victim)


def test_workers_cannot_run_past_a_kill_not_yet_made() -> None:
    # A CI run whose requests all ended before its second kill never killed D (and so never saw a
    # D-side quarantine that P's kill left): until a kill is made, at most ``concurrency`` requests
    # start past its moment, one request per kill to come stays unsent, and workers waiting out a
    # restart at the gate hold no index.
    cfg = ChaosConfig(requests=24, kills=2, seed=3, concurrency=8)
    run = ChaosRun(cfg, cast(Cluster, None), cast(ServerGroup, None), ["p"], [[1]], "m")

    def take_in_thread() -> tuple[threading.Thread, list[tuple[int, bool] | None]]:
        got: list[tuple[int, bool] | None] = []
        worker = threading.Thread(target=lambda: got.append(run._take()), daemon=True)
        worker.start()
        worker.join(0.3)
        assert worker.is_alive() and got == []  # waiting, bounded by the test's joins
        return worker, got

    try:
        first, second = PlannedKill(10, 0.0, Victim.PREFILL, 1.0), PlannedKill(12, 0.0, Victim.DECODE, 1.0)
        run.hold_for([first, second])
        assert [run._take() for _ in range(18)] == [(i, False) for i in range(18)]
        worker, late = take_in_thread()  # held at 10 + 8
        run.hold_for([])  # the kill is made
        worker.join(5.0)
        assert late == [(18, False)]
        # Armed at the restart, past the next moment: up to 8 more from where the run is, but one
        # request stays unsent for the last kill (23 of 24).
        run.hold_for([second])
        assert [run._take() for _ in range(4)] == [(i, False) for i in range(19, 23)]
        worker, late = take_in_thread()
        run.hold_while_down(1)  # the second kill is made; a third would come: still held at 23
        run.up.clear()  # a peer is down: the held worker would be the prober
        worker.join(0.3)
        assert worker.is_alive() and late == []
        run.hold_while_down(0)  # no kill to come
        worker.join(5.0)
        assert late == [(23, True)]
        run._probe.release()
        assert run._take() is None  # all 24 taken
        run._next_index = 5
        run.up.clear()
        assert run._take() == (5, True)  # the prober, while the others wait at the gate
        worker, gated = take_in_thread()
        assert run._next_index == 6  # the gated worker holds no index
        run.up.set()
        worker.join(5.0)
        assert gated == [(6, False)]
    finally:
        run.client.close()


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        ChaosConfig(requests=0)
    with pytest.raises(ConfigError):
        ChaosConfig(min_down_s=3.0, max_down_s=1.0)
    with pytest.raises(ConfigError):
        ChaosConfig(deadline_s=0)


def _rec(
    final: Final, tokens: list[int], start: float = 0.0, end: float = 1.0, detail: str = ""
) -> RequestRecord:
    return RequestRecord(0, 0, start=start, end=end, final=final, detail=detail, token_ids=tokens)


def test_judge_checks_whole_answers_and_the_prefix_of_broken_ones() -> None:
    ref = [5, 6, 7, 8]
    ok = _rec(Final.OK, [5, 6, 7, 8])
    judge(ok, ref)
    assert ok.final is Final.OK and ok.state == "ok"
    short = _rec(Final.OK, [5, 6, 7])
    judge(short, ref)
    assert short.final is Final.CORRUPTED and short.detail == "ok"
    broken = _rec(Final.STREAM_ERROR, [5, 6], detail="engine_error")
    judge(broken, ref)
    assert broken.final is Final.STREAM_ERROR and broken.state == "stream_error_engine_error"
    wrong = _rec(Final.STREAM_ERROR, [5, 9], detail="engine_error")
    judge(wrong, ref)
    assert wrong.final is Final.CORRUPTED and wrong.state == "corrupted"
    refused = _rec(Final.HTTP_ERROR, [], detail="503_service_unavailable")
    judge(refused, ref)
    assert refused.state == "http_503_service_unavailable"


def test_figures_attribute_request_ends_to_the_kill_they_outlived() -> None:
    records = [
        _rec(Final.OK, [1], start=0.0, end=1.0),
        _rec(Final.HTTP_ERROR, [], start=1.5, end=4.5, detail="502_engine_error"),  # in flight at 2.0
        _rec(Final.HTTP_ERROR, [], start=2.5, end=2.6, detail="503_service_unavailable"),  # while down
        _rec(Final.OK, [1], start=6.0, end=6.5),  # after the restart
        RequestRecord(4, 0),  # never ran
    ]
    kills = [KillEvent("prefill", killed_at=2.0, restarted_at=3.0, back_at=5.0)]
    assert max_end_s(records, kills) == pytest.approx(2.5)
    assert max_end_s(records, []) == pytest.approx(3.0)  # nothing to attribute: the slowest request
    assert recovered(records, kills, 0) is True
    assert by_state(records) == {
        "ok": 2, "http_502_engine_error": 1, "http_503_service_unavailable": 1, "not_run": 1
    }  # fmt: skip
    data = summary(records, kills, {"prefill": 0, "decode": 3})
    assert data == {
        "requests": 5,
        "by_state": by_state(records),
        "leaked_blocks": {"prefill": 0, "decode": 3},
        "corrupted": 0,
        "max_end_s": 2.5,
    }
    found = problems(records, kills, {"prefill": 0, "decode": 3}, [[1]])
    assert any("decode: 3 KV blocks leaked" in p for p in found)
    assert any("never started" in p for p in found)


def test_a_clean_run_has_no_problems_and_a_silent_engine_or_no_recovery_is_one() -> None:
    records = [_rec(Final.OK, [1], start=0.0, end=1.0), _rec(Final.OK, [1], start=6.0, end=7.0)]
    kills = [KillEvent("decode", killed_at=2.0, back_at=5.0)]
    assert problems(records, kills, {"prefill": 0, "decode": 0}, [[1]]) == []
    assert problems(records, kills, {"prefill": 0, "decode": None}, [[1]]) == [
        "decode: no block accounting (engine not answering)"
    ]
    failing_after = [records[0], _rec(Final.HTTP_ERROR, [], start=6.0, end=6.1, detail="502_engine_error")]
    assert any("no request succeeded" in p for p in problems(failing_after, kills, {}, [[1]]))
    never_back = [KillEvent("decode", killed_at=2.0, error="restart failed: boom")]
    assert any("restart failed" in p for p in problems(records, never_back, {}, [[1]]))
