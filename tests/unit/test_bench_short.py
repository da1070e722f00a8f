"""``kvwire bench short``'s pure parts: step medians from timeline marks, per-process CPU, the timeline."""

from __future__ import annotations

import os

import pytest

from kvwire.connector.timeline import Stage, Timeline, merged
from kvwire_tools.bench.short import _COLOC_STEPS, _disagg_marks, _steps, cpu_per_request, cpu_seconds


def test_disaggregated_marks_line_up_p_d_and_the_client() -> None:
    p = {"id": "t", "arrived": 1.001, "loop_received": 1.010, "push_reg_received": 1.004}
    d = {"id": "t", "arrived": 1.002, "done_received": 1.013}
    marks = _disagg_marks(1.0, 1.020, p, d)
    assert marks["client"] == 1.0 and marks["client_first"] == 1.020
    assert marks["p.arrived"] == 1.001 and marks["d.done_received"] == 1.013
    assert marks["p.ready"] == 1.010  # the later of the finished request and the push_reg


def test_steps_are_medians_in_ms_and_missing_marks_give_none() -> None:
    records = [
        {"client": 0.0, "c.arrived": 0.001, "c.first_token": 0.005, "client_first": 0.006},
        {"client": 1.0, "c.arrived": 1.003, "c.first_token": 1.007, "client_first": 1.008},
        {"client": 2.0, "c.arrived": 2.002, "c.first_token": 2.006, "client_first": 2.007},
    ]
    steps = _steps(records, _COLOC_STEPS)
    assert abs(steps["client -> engine arrival"] - 2.0) < 1e-6  # type: ignore[operator]
    assert abs(steps["engine arrival -> first token"] - 4.0) < 1e-6  # type: ignore[operator]
    assert steps["token -> answer"] is None


def test_cpu_seconds_of_this_process_grow() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before


def test_timeline_keeps_the_first_mark_and_drops_the_oldest_request() -> None:
    tl = Timeline(capacity=2)
    tl.mark("a", Stage.ARRIVED, 1.0)
    tl.mark("a", Stage.ARRIVED, 2.0)
    tl.mark("b", Stage.ARRIVED, 3.0)
    tl.mark("c", Stage.ARRIVED, 4.0)
    assert tl.keys() == ["b", "c"]
    other = Timeline()
    other.mark("b", Stage.PUSH_REG_SENT, 3.5)
    assert merged("b", tl, other) == {"id": "b", "arrived": 3.0, "push_reg_sent": 3.5}


def test_cpu_per_request_divides_each_process_delta_by_the_requests() -> None:
    per = cpu_per_request({"router": 1.0, "prefill": 2.0}, {"router": 1.3, "prefill": 2.9}, 100)
    assert per == pytest.approx({"router": 3.0, "prefill": 9.0})
    assert cpu_per_request({"d": 0.0}, {"d": 0.5}, 0) == {"d": 500.0}  # no division by zero


def test_fleet_bench_asks_for_the_model_of_its_preset() -> None:
    """The engines serve ``kvwire-{preset}`` (and refuse other names): the fleet bench must ask for it."""
    from kvwire_tools.bench.fleet_load import FleetSetup

    assert FleetSetup().model == "kvwire-tiny"
    assert FleetSetup(preset="kv-heavy").model == "kvwire-kv-heavy"
