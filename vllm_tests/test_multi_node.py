"""A multi-node engine under vLLM 0.34: the scheduler's connector learns each rank's host from the
workers' handshake metadata (as vLLM's EngineCore hands it over at start) and registers in etcd only
then, so the fleet's first record already names every rank's host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import build_scheduler

from kvwire.integrations.vllm import connector as connector_module
from kvwire.integrations.vllm.params import KvRole, RankChannel
from kvwire.integrations.vllm.scheduler import LocalEngine


def test_the_etcd_registration_waits_for_the_workers_hosts(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []

    def start_registration(settings: Any, kv_role: KvRole, local: Any, model: str) -> None:
        started.append(local)  # what the registrar would read at its first put

    monkeypatch.setattr(connector_module, "start_registration", start_registration)
    extra = {"discovery": "etcd://127.0.0.1:2379/f", "discovery_url": "http://127.0.0.1:8000",
             "side_channel_port": 5700}  # fmt: skip
    sched = build_scheduler(model_dir, KvRole.PRODUCER, "p-multi", 32, extra, prefix_caching=False)
    conn = sched.get_kv_connector()
    assert conn is not None and started == []  # not at construction: the hosts are not known yet
    # vLLM's EngineCore, after the workers registered their KV caches: {(pp, tp): metadata}.
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): RankChannel("127.0.0.2", 5700)})
    assert len(started) == 1
    local: LocalEngine = started[0]()
    assert (local.host, local.hosts) == ("127.0.0.1", ("127.0.0.2",))
    # Another sub-connector's metadata (vLLM's MultiConnector hands one to all): ignored, no error.
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): object()})
    assert len(started) == 1
