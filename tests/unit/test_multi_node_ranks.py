"""A P engine whose ranks sit on several hosts (multi-node PP under vLLM): each worker binds its node's
address (``KVWIRE_SIDE_CHANNEL_HOST``), the scheduler learns every rank's host from the workers (vLLM's
handshake metadata) and names them in P's answer (``remote_hosts``); D, the router and the etcd record
carry them to where D dials. The transfer itself over real NIXL: test_vllm_worker_geometry.py
(``test_pipeline_stages_of_p_on_two_hosts``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from kvwire.config import ENV_SIDE_CHANNEL_HOST
from kvwire.discovery.record import EngineRecord, FleetRole, SideChannel
from kvwire.errors import ConfigError, InvalidRequest
from kvwire.integrations.api import remote_engine
from kvwire.integrations.vllm.discovery import vllm_record
from kvwire.integrations.vllm.params import KvRole, RankChannel, rank_host, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire.integrations.vllm.worker import RankPlace, WorkerSide
from kvwire.kv.mapping import MAX_TP
from kvwire.kv_params import MAX_REMOTE_TP, parse_kv_params
from kvwire.router import dialects
from kvwire.router.fleet import health_info
from kvwire.router.legs import decode_body, pull_params
from kvwire.router.policy import Role

HOSTS = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]  # tp 2, pp 2: stage 1 on the second node


SETTINGS = {"side_channel_port": 5700, "insecure": True, "side_channel_host": "10.0.0.1"}


def _sched(mode: str = "push") -> SchedulerSide:
    settings = settings_from_extra(SETTINGS | {"mode": mode})
    local = LocalEngine("P", "10.0.0.1", 5700, tp_size=2, pp_size=2, incarnation="i1")
    return SchedulerSide(KvRole.PRODUCER, settings, local, 16)


def _channels(hosts: list[str], port: int = 5700) -> dict[tuple[int, int], RankChannel]:
    return {(r // 2, r % 2): RankChannel(h, port + r) for r, h in enumerate(hosts)}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ps_answer_names_each_ranks_host_and_d_dials_it(mode: str) -> None:
    sched = _sched(mode)
    sched.set_channels(_channels(HOSTS))
    _, raw = sched.finished("r1", {"do_remote_decode": True}, [3, 4], 20, False)
    assert raw is not None and raw["remote_hosts"] == HOSTS
    remote = remote_engine(parse_kv_params(raw), rank_ports=True)
    dialled = {
        rank: (remote.host_of(rank), remote.port_of(rank)) for rank in [(0, 0), (0, 1), (1, 0), (1, 1)]
    }
    assert dialled == {(0, 0): ("10.0.0.1", 5700), (0, 1): ("10.0.0.1", 5701),
                       (1, 0): ("10.0.0.2", 5702), (1, 1): ("10.0.0.2", 5703)}  # fmt: skip


def test_one_host_adds_nothing_to_the_answer() -> None:
    sched = _sched()
    sched.set_channels(_channels(["10.0.0.1"] * 4))
    _, raw = sched.finished("r1", {"do_remote_decode": True}, [3], 10, False)
    assert raw is not None and "remote_hosts" not in raw  # what D and older peers read, unchanged
    assert remote_engine(parse_kv_params(raw)).host_of((1, 1)) == "10.0.0.1"


def test_a_rank_that_reports_nothing_is_at_side_channel_host_and_another_port_stops_the_engine() -> None:
    # Only ranks whose node set KVWIRE_SIDE_CHANNEL_HOST report (the head node here sets none).
    channels = {k: v for k, v in _channels(HOSTS).items() if v.host != "10.0.0.1"}
    sched = _sched()
    sched.set_channels(channels)
    assert sched.local.hosts == tuple(HOSTS)
    with pytest.raises(ConfigError, match="same kv_connector_extra_config"):
        _sched().set_channels(_channels(HOSTS, port=5800))


def test_a_worker_reports_its_channel_only_when_its_node_set_an_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without KVWIRE_SIDE_CHANNEL_HOST a worker reports nothing (vLLM's MultiConnector hands one
    sub-connector's metadata to all of them: kvwire's beside NIXL's made NIXL refuse to start)."""
    place = RankPlace("P", "i", "m", tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, num_layers=4, kv_heads=2,
                      head_dim=8, block_size=16)  # fmt: skip
    settings = settings_from_extra(
        {"side_channel_port": 5700, "insecure": True, "side_channel_host": "10.0.0.1"}
    )
    monkeypatch.delenv(ENV_SIDE_CHANNEL_HOST, raising=False)
    assert WorkerSide(KvRole.PRODUCER, settings, place).channel() is None
    monkeypatch.setenv(ENV_SIDE_CHANNEL_HOST, "10.0.0.2")
    assert WorkerSide(KvRole.PRODUCER, settings, place).channel() == RankChannel("10.0.0.2", 5703)
    # Metadata that is not kvwire's (another sub-connector's) names no host: every rank at the one host.
    sched = _sched()
    sched.set_channels({})
    assert sched.local.hosts == ()


def test_remote_hosts_must_name_one_host_per_rank() -> None:
    base: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "P",
                            "remote_host": "h", "remote_port": 5700, "remote_tp_size": 2}  # fmt: skip
    with pytest.raises(InvalidRequest, match="names 3 hosts for P's 2 ranks"):
        remote_engine(parse_kv_params(base | {"remote_hosts": ["a", "b", "c"]}))
    with pytest.raises(InvalidRequest):  # bounded before anything is built from it
        parse_kv_params(base | {"remote_hosts": ["a"] * 5000})
    # P's geometry is bounded too: each rank is a handshake D makes for the request.
    assert MAX_REMOTE_TP == MAX_TP
    with pytest.raises(InvalidRequest):
        parse_kv_params(base | {"remote_tp_size": MAX_TP + 1})
    with pytest.raises(InvalidRequest, match="at most 512 ranks"):
        remote_engine(parse_kv_params(base | {"remote_tp_size": 64, "remote_pp_size": 9}))
    assert remote_engine(parse_kv_params(base | {"remote_tp_size": 64, "remote_pp_size": 8})).tp_size == 64
    with pytest.raises(InvalidRequest):
        parse_kv_params(base | {"remote_hosts": ["a", ""]})
    # Refused in vLLM's scheduler too: the request is served locally, counted, nothing crashes.
    d = SchedulerSide(KvRole.CONSUMER, settings_from_extra({}), LocalEngine("D", "h", 1, 1, 1), 16)
    assert d.matched_tokens("r", base | {"remote_hosts": ["a"]}, 32, 0) == (0, False)
    assert d.rejected == 1


def test_a_workers_host_comes_from_its_environment_and_is_checked() -> None:
    s = settings_from_extra({"side_channel_host": "127.0.0.1"})
    assert rank_host(s, {}) == "127.0.0.1"
    assert rank_host(s, {ENV_SIDE_CHANNEL_HOST: "127.0.0.2"}) == "127.0.0.2"
    with pytest.raises(ConfigError, match="D would dial itself"):
        rank_host(s, {ENV_SIDE_CHANNEL_HOST: "0.0.0.0"})
    # A routable address without KVWIRE_SECRET is refused, as side_channel_host is.
    with pytest.raises(ConfigError, match=ENV_SIDE_CHANNEL_HOST):
        rank_host(s, {ENV_SIDE_CHANNEL_HOST: "10.0.0.2"})
    insecure = settings_from_extra({"insecure": True})
    assert rank_host(insecure, {ENV_SIDE_CHANNEL_HOST: "10.0.0.2"}) == "10.0.0.2"


def test_the_etcd_record_lists_each_ranks_host_once_the_workers_said() -> None:
    sched = _sched()
    extra = {"discovery": "etcd://127.0.0.1:2379", "discovery_url": "http://10.0.0.1:8000",
             "side_channel_port": 5700, "insecure": True}  # fmt: skip
    settings = settings_from_extra(extra)
    before = vllm_record(settings, KvRole.PRODUCER, sched.local, "m")
    assert {c.host for c in before.side_channels} == {"10.0.0.1"}
    sched.set_channels(_channels(HOSTS))
    rec = vllm_record(settings, KvRole.PRODUCER, sched.local, "m")
    assert [(c.pp_rank, c.tp_rank, c.host, c.port) for c in rec.side_channels] == [
        (0, 0, "10.0.0.1", 5700), (0, 1, "10.0.0.1", 5701), (1, 0, "10.0.0.2", 5702), (1, 1, "10.0.0.2", 5703)
    ]  # fmt: skip
    # The router reads them back, and names them in D's leg (push: from the record, not P's answer).
    info = health_info(rec)
    assert list(info.side_channel_hosts) == HOSTS
    leg = decode_body({"prompt": "x"}, "t1", info)["kv_transfer_params"]
    assert leg["remote_hosts"] == HOSTS
    assert remote_engine(parse_kv_params(leg), rank_ports=True).host_of((1, 0)) == "10.0.0.2"


def test_a_record_that_lists_not_every_rank_names_no_hosts() -> None:
    ranks = tuple(SideChannel(0, t, f"10.0.0.{t + 1}", 5700 + t) for t in range(2))
    rec = EngineRecord(FleetRole.PREFILL, "P", "i", "m", "http://p:1", "10.0.0.1", 5700,
                       side_channels=ranks, tp_size=2, pp_size=2, updated=time.time())  # fmt: skip
    assert health_info(rec).side_channel_hosts == ()
    # Sizes any writer under the prefix may set: looked at only once the ranks listed match them (a
    # 170-byte record with tp and pp of 10**6 held the router's loop building 10**12 pairs).
    huge = msgspec.structs.replace(rec, tp_size=10**6, pp_size=10**6)
    started = time.perf_counter()
    assert health_info(huge).side_channel_hosts == ()
    assert time.perf_counter() - started < 0.5


def test_pull_legs_carry_ps_hosts_and_a_static_router_takes_them_from_the_url() -> None:
    answer = {"kv_transfer_params": {"remote_block_ids": [1], "remote_engine_id": "P", "remote_host": "a",
                                     "remote_port": 1, "remote_tp_size": 1, "remote_pp_size": 2,
                                     "remote_hosts": ["a", "b"]}}  # fmt: skip
    assert pull_params("http://p:1", answer)["remote_hosts"] == ["a", "b"]
    # P's prompt length goes to D too (D refuses another prompt: it would read slots P never wrote).
    answer["kv_transfer_params"]["num_tokens"] = 17
    assert pull_params("http://p:1", answer)["num_tokens"] == 17
    vllm = dialects.lookup("vllm")
    url = "http://p:1#engine_id=P&side_channel=a:5700&pp=2&side_channel_hosts=a,b"
    info = vllm.static_info(url, Role.PREFILL)
    assert info is not None and info.side_channel_hosts == ("a", "b")
    for bad in ("a", "a,a:5701", "a,0.0.0.0", "a, b", "a,"):
        with pytest.raises(ConfigError, match="one host per rank"):
            vllm.static_info(
                f"http://p:1#engine_id=P&side_channel=a:5700&pp=2&side_channel_hosts={bad}", Role.PREFILL
            )
    assert vllm.static_info("http://p:1#engine_id=P&side_channel=a:5700&pp=2&side_channel_hosts=a,fd00::2",
                            Role.PREFILL).side_channel_hosts == ("a", "fd00::2")  # fmt: skip
