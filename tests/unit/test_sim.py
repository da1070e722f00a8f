"""The deterministic simulation: the real cores under seeded faults keep every invariant, a seed replays
exactly, and each planted bug is caught (while the real cores, under the same faults, are not)."""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.protocol.messages import TransferMode
from kvwire.testing.sim import Faults, Plant, Report, simulate
from kvwire.testing.sim.plants import PLANTS
from kvwire.testing.sim.run import SPEC, Shapes


def _chaos(args: tuple[int, int, str]) -> Report:
    requests, seed, mode = args
    return simulate(requests, seed, mode=TransferMode(mode))


def _assert_clean(report: Report) -> None:
    replay = f"kvwire sim --requests {report.requests} --seed {report.seed} --mode {report.mode}"
    assert report.violations == [], replay
    # Faults really happened, and requests both succeeded and failed under them.
    assert report.outcomes.get("d_ready", 0) > report.requests // 2
    assert sum(report.faults.values()) > 0


@pytest.mark.parametrize(("mode", "layerwise"), [("push", False), ("pull", False), ("push", True)])
def test_real_cores_under_chaos_keep_every_invariant(mode: str, layerwise: bool) -> None:
    report = simulate(4000 if not layerwise else 2500, 11, mode=TransferMode(mode), layerwise=layerwise)
    _assert_clean(report)
    failed = sum(v for k, v in report.outcomes.items() if k.startswith("d_released"))
    assert failed > 0  # the faults made some requests fail, and those too ended cleanly


@pytest.mark.parametrize(("mode", "layerwise"), [("push", False), ("pull", False), ("push", True)])
def test_one_kv_head_replicated_on_p_keeps_every_invariant_under_chaos(mode: str, layerwise: bool) -> None:
    """One KV head: P1's two TP ranks hold the same head, and D0 (TP 1) reads it from rank 0 only, so it
    registers with rank 1 too (an idle rank, ``kv.mapping.tp_contacts``). Under every fault, nothing
    is lost, freed twice or held past its bound."""
    one_head = dataclasses.replace(SPEC, kv_heads=1)
    report = simulate(1500, 13, mode=TransferMode(mode), layerwise=layerwise, spec=one_head)
    _assert_clean(report)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tp_16_on_p_across_two_nodes_keeps_every_invariant_under_chaos(mode: str) -> None:
    """P at TP 16 (two 8-GPU nodes; kvwire mapped at most TP 8 before), two KV heads each replicated on 8
    of P's ranks, into D at TP 8 and TP 1: D reads each head from one replica and tells the idle ones,
    16 P ranks per request. Under every fault, nothing is lost, freed twice or held past its bound."""
    spec = dataclasses.replace(SPEC, kv_heads=2)
    shapes = Shapes(ps=((16, 1), (16, 2)), ds=(8, 1))
    report = simulate(800, 21, mode=TransferMode(mode), spec=spec, shapes=shapes)
    _assert_clean(report)
    assert report.outcomes["d_ready"] > 600  # transfers complete, not merely fail cleanly


def test_one_core_holding_every_rank_of_a_tp_64_pp_5_p_serves_every_request() -> None:
    """kvwire's own engine runs all its ranks in one core: 320 P ranks, each pairing with D, held 320
    registrations per request, past the 256 of max_registrations_per_request: every request failed as
    overloaded. The core's bound now covers what its own ranks take."""
    spec = dataclasses.replace(SPEC, kv_heads=64, num_layers=5)
    report = simulate(10, 1, faults=Faults(), spec=spec, shapes=Shapes(ps=((64, 5),), ds=(1,)))
    assert report.violations == [] and report.outcomes == {"p_sent": 10, "d_ready": 10}


def test_a_seed_replays_exactly() -> None:
    a, b = simulate(800, 5), simulate(800, 5)
    assert (a.violations, a.outcomes, a.faults, a.simulated_seconds) == (
        b.violations,
        b.outcomes,
        b.faults,
        b.simulated_seconds,
    )
    assert simulate(800, 6).outcomes != a.outcomes


@pytest.mark.parametrize(("mode", "seed"), [("push", 6), ("push", 7), ("pull", 6)])
def test_a_crashed_p_is_confirmed_gone_before_the_quarantine_bound(mode: str, seed: int) -> None:
    # Crashes only, half of them restarting under a new engine id as real servers do: no freeze and no
    # partition, so every dead P life's address answers (a new life) and must confirm it; a release at
    # the bound means D held blocks ~30 s for nothing. Push seeds 6 and 7 found D's probe naming the
    # dead life's engine id (refused as another engine) once the simulator gave restarts new ids.
    report = simulate(2000, seed, faults=Faults(crash=2.0), mode=TransferMode(mode))
    assert report.violations == []
    assert report.outcomes["crash_new_id"] > 0 and report.outcomes["crash"] > report.outcomes["crash_new_id"]
    assert "d_quarantine_expired" not in report.outcomes
    # A request whose P restarted is peer_dead (retryable), never incompatible (a misconfiguration).
    assert not any(k.endswith("incompatible") for k in report.outcomes)


@pytest.mark.parametrize(
    ("seed", "layerwise", "partition"), [(1112, False, 0.05), (1124, False, 0.5), (1124, True, 0.5)]
)
def test_a_d_frozen_while_p_is_frozen_never_frees_blocks_p_still_writes(
    seed: int, layerwise: bool, partition: float
) -> None:
    """Found by a fuzzing helper under heavy pauses: D frozen, P's heartbeats queued behind the freeze,
    then P frozen with a write posted. D's first tick after its thaw took its own freeze for P's silence
    and declared P dead; the heartbeats read right after (sent before P froze) confirmed that verdict,
    and D freed the blocks; P thawed and its recalled write landed in them (C1). D now notices its own
    freeze, as P does, and restarts the P lives' silence clocks."""
    faults = dataclasses.replace(Faults.chaos(), pause=1.0, partition=partition)
    report = simulate(2000 if partition == 0 else 1500, seed, faults=faults, layerwise=layerwise)
    assert report.violations == []
    assert report.faults["pause"] > 0


def test_fault_free_run_delivers_every_request() -> None:
    report = simulate(1000, 3, faults=Faults())
    assert report.violations == []
    assert report.outcomes == {"p_sent": 1000, "d_ready": 1000}


@pytest.mark.parametrize(("mode", "layerwise"), [("push", False), ("pull", False), ("push", True)])
def test_every_request_d_declines_frees_ps_blocks_before_the_lease(mode: str, layerwise: bool) -> None:
    """D drops a tenth of the requests before allocating and tells P (``Decline``): P ends each one
    aborted (push: D's cancel, before or after P's prefill finished; pull: D's failed/aborted), none at
    its lease, and none counted as a failure."""
    report = simulate(1000, 5, faults=Faults(decline=0.1), mode=TransferMode(mode), layerwise=layerwise)
    declined = report.outcomes["d_declined"]
    assert report.violations == [] and declined > 50
    assert report.outcomes["p_aborted"] == declined and "p_expired" not in report.outcomes
    assert report.outcomes["d_ready"] == 1000 - declined


def test_fault_free_layerwise_run_streams_every_request_before_it_finishes() -> None:
    # Each layer is written as P's step computes it, the last with done once all are: D is READY before
    # P's request_finished for most requests (the rest registered after the step, or share it with a
    # digest), and every READY request's bytes were compared with P's.
    report = simulate(1000, 3, faults=Faults(), layerwise=True)
    assert report.violations == [] and report.layerwise and report.as_json()["layerwise"] is True
    assert (report.outcomes["p_sent"], report.outcomes["d_ready"]) == (1000, 1000)
    assert report.outcomes["d_ready_before_p_finished"] > 500


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_metering_the_cores_changes_nothing_and_counts_part_of_the_run(mode: str) -> None:
    plain = simulate(600, 5, mode=TransferMode(mode))
    metered = simulate(600, 5, mode=TransferMode(mode), meter_cores=True)
    assert (metered.violations, metered.outcomes, metered.faults, metered.simulated_seconds) == (
        plain.violations,
        plain.outcomes,
        plain.faults,
        plain.simulated_seconds,
    )
    assert plain.core_cpu_seconds is None and "core_cpu_seconds" not in plain.as_json()
    assert metered.core_cpu_seconds is not None
    # The cores ran, and they are not the whole run.
    assert 0.0 < metered.core_cpu_seconds < metered.cpu_seconds
    assert metered.as_json()["core_us_per_request"] == round(metered.core_cpu_seconds / 600 * 1e6, 1)
    # The breakdown by (core, input) kind adds up to the whole, and names the inputs each mode has.
    assert sum(cpu for cpu, _ in metered.core_cpu_by.values()) == pytest.approx(metered.core_cpu_seconds)
    kinds = set(metered.core_cpu_by)
    if mode == "push":  # P plans and writes on Finished; D hears P's done
        producer = "PushProducerCore"
        expected = {(producer, "Finished"), (producer, "XferEnded"), ("PushConsumerCore", "NotifIn")}
    else:  # D plans and reads once P's handshake is in; P judges claims
        producer = "PullProducerCore"
        expected = {(producer, "Finished"), (producer, "ClaimArrived"), ("PullConsumerCore", "XferEnded")}
    assert expected <= kinds
    assert ("HandshakeCore", "Lookup") in kinds
    finished = metered.core_cpu_by[(producer, "Finished")][1]
    assert 0.9 * 600 <= finished <= 600  # one per request P prefilled (a few are aborted before)
    rows = metered.core_inputs()
    assert [r["us_per_request"] for r in rows] == sorted((r["us_per_request"] for r in rows), reverse=True)
    assert plain.core_cpu_by == {} and plain.core_inputs() == []


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_each_planted_bug_is_caught(name: str) -> None:
    planted = PLANTS[name]
    seed, faults = planted.seed, planted.faults
    run = functools.partial(simulate, mode=planted.mode, layerwise=planted.layerwise)
    caught = run(6000, seed, faults=faults, plant=planted.plant, stop_at_first=True)
    assert caught.violations, f"{name} went unnoticed"
    assert planted.breaks in caught.violations[0]
    if planted.plant.producer is not None and planted.plant.consumer is not None:
        # A layered plant: each half alone is not what this schedule catches.
        for half in (Plant(producer=planted.plant.producer), Plant(consumer=planted.plant.consumer)):
            alone = run(6000, seed, faults=faults, plant=half, stop_at_first=True)
            assert alone.violations == [] or alone.violations[0] != caught.violations[0]
    # The same schedule with the real cores is clean: the violation is the plant's.
    real = run(1000, seed, faults=faults)
    assert real.violations == []


def test_cli_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "kvwire.cli", "sim", "--requests", "300", "--seed", "2", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert {"requests", "seed", "violations", "faults", "wall_seconds"} <= report.keys()
    assert report["requests"] == 300 and report["seed"] == 2 and report["violations"] == []
    # The figures issue 21's speed goal is stated in (requests per second of one process), from the run's
    # own times: checked against them, never against a speed (the machine is shared).
    assert report["requests_per_second"] == pytest.approx(300 / report["wall_seconds"], rel=0.01)
    assert 0 < report["cpu_seconds"] <= report["wall_seconds"] * 1.05 + 0.01
    assert report["requests_per_cpu_second"] == pytest.approx(300 / report["cpu_seconds"], rel=0.01)
    assert "requests/s" in done.stdout and "requests per CPU second" in done.stdout


def test_cli_meters_the_cores_on_request(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "kvwire.cli", "sim", "--requests", "200", "--seed", "2", "--meter-cores"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert 0 < report["core_cpu_seconds"] < report["cpu_seconds"]
    printed = re.search(r"^cores: .* (\d+) us per request", done.stdout, re.M)
    assert printed is not None, done.stdout
    assert float(printed.group(1)) == pytest.approx(report["core_us_per_request"], abs=1.0)
    costliest = report["core_inputs"][0]
    line = f"  {costliest['core']} {costliest['input']}: {costliest['us_per_request']} us per request"
    assert line in done.stdout


def test_cli_fails_and_prints_the_replay_line_on_a_planted_bug() -> None:
    cmd = [sys.executable, "-m", "kvwire.cli", "sim", "--requests", "500", "--plant", "ack-before-writes-end"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "VIOLATION" in done.stdout and "replay: kvwire sim" in done.stdout


@pytest.mark.slow
def test_a_hundred_thousand_requests_under_chaos() -> None:
    """100,000 simulated requests (two processes, push and pull), every invariant kept."""
    jobs = [(25_000, seed, mode) for seed in (101, 102) for mode in ("push", "pull")]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        reports = pool.map(_chaos, jobs)
    assert sum(r.requests for r in reports) == 100_000
    for report in reports:
        _assert_clean(report)


def test_the_schedule_does_not_depend_on_the_cores() -> None:
    """Arrivals, request shapes and the partitions, pauses, crashes and aborts come from a stream of their
    own: a planted core meets the same schedule as the real one (an A/B comparison under one seed)."""
    planted = PLANTS["ack-after-done"]
    schedule = ("partition", "pause", "crash", "abort")
    real = simulate(1500, 3, faults=Faults.chaos())
    other = simulate(1500, 3, faults=Faults.chaos(), plant=planted.plant)
    assert real.outcomes != other.outcomes  # the cores behaved differently...
    assert {k: real.faults.get(k, 0) for k in schedule} == {k: other.faults.get(k, 0) for k in schedule}
    assert sum(real.faults.get(k, 0) for k in schedule) > 0  # ...under the same schedule


def test_cli_refuses_layerwise_pull_naming_the_fix() -> None:
    cmd = [sys.executable, "-m", "kvwire.cli", "sim", "--requests", "10", "--layerwise", "--mode", "pull"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "--layerwise is a push mode" in done.stderr and "drop --mode pull" in done.stderr


@pytest.mark.slow
def test_lost_notifications_end_within_the_bound() -> None:
    """1 % of notifications lost, nothing else: a lost done used to keep D waiting while P, serving other
    registrations, heartbeated on (seed 1 of the tree before: 10 requests past the bound, D's failed
    requests held p50 57 s); D now ends a registration P stopped naming (p50 19 s, max 52 s here)."""
    report = simulate(20_000, 1, faults=Faults(drop=0.01))
    assert report.violations == []
    assert report.outcomes["d_released_transfer_timeout"] > 100
