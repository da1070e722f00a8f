from __future__ import annotations

import pytest

from kvwire.config import Policy
from kvwire.router.policy import EngineView, Load, NoHealthyEngine, Picker, Role, busy, least_loaded


def view(
    url: str, healthy: bool = True, running: int = 0, waiting: int = 0, free: int = 10, inflight: int = 0
) -> EngineView:
    return EngineView(url, healthy, Load(running, waiting, free), inflight)


def test_round_robin_rotates_over_healthy_engines_per_role() -> None:
    picker = Picker(Policy.ROUND_ROBIN)
    engines = [view("a"), view("b", healthy=False), view("c")]
    assert [picker.pick(Role.PREFILL, engines).url for _ in range(4)] == ["a", "c", "a", "c"]
    # The decode rotation is independent of the prefill one.
    assert picker.pick(Role.DECODE, engines).url == "a"


def test_no_healthy_engine_raises_typed_error() -> None:
    picker = Picker(Policy.LEAST_LOADED)
    with pytest.raises(NoHealthyEngine) as err:
        picker.pick(Role.DECODE, [view("a", healthy=False)])
    assert err.value.role is Role.DECODE
    with pytest.raises(NoHealthyEngine):
        picker.pick(Role.PREFILL, [])


def test_least_loaded_takes_fewest_running_plus_waiting() -> None:
    engines = [view("a", running=3), view("b", running=1, waiting=1), view("c", running=2, waiting=2)]
    assert least_loaded(engines).url == "b"


def test_least_loaded_counts_router_inflight_when_reports_lag() -> None:
    engines = [view("a", running=1), view("b", inflight=4)]
    assert busy(engines[1]) == 4
    assert least_loaded(engines).url == "a"


def test_least_loaded_ties_go_to_free_blocks_then_rotate() -> None:
    assert least_loaded([view("a", free=5), view("b", free=50)]).url == "b"
    picker = Picker(Policy.LEAST_LOADED)
    equal = [view("a"), view("b"), view("c")]
    assert [picker.pick(Role.PREFILL, equal).url for _ in range(3)] == ["a", "b", "c"]


def test_least_loaded_skips_unhealthy() -> None:
    picker = Picker(Policy.LEAST_LOADED)
    engines = [view("idle-but-down", healthy=False), view("busy", running=9)]
    assert picker.pick(Role.PREFILL, engines).url == "busy"
