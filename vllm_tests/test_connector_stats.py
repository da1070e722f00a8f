"""kvwire's counters on vLLM's stats path: what ``get_kv_connector_stats`` hands vLLM after a real
transfer between two vLLM schedulers, summed as vLLM sums workers, logged as vLLM logs it ("KV Transfer
metrics: ...") and exported as ``vllm:kvwire_*`` families by vLLM's own ``KVConnectorProm``."""

from __future__ import annotations

from typing import Any

import pytest
from harness import BS, HEAD_DIM, KV_HEADS, LAYERS, MakeEngine, d_params, p_params, prompt, run
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

from kvwire.integrations.vllm.connector import KvwireConnector
from kvwire.integrations.vllm.params import KvRole
from kvwire.integrations.vllm.prom import KvwireStats

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]
BLOCK_BYTES = LAYERS * KV_HEADS * BS * 2 * HEAD_DIM * 4  # float32 K and V of every layer


def _prom(registry: CollectorRegistry, vllm_config: Any) -> KVConnectorProm:
    """vLLM's exporter, its families in a registry of this test's (vLLM's default is process-global)."""

    def bound(cls: Any) -> Any:
        return type(
            cls.__name__, (cls,), {"__init__": lambda s, *a, **k: cls.__init__(s, *a, registry=registry, **k)}
        )

    class Prom(KVConnectorProm):  # type: ignore[misc]
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    return Prom(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})


def _sample(text: str, name: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_a_transfer_reaches_vllms_log_and_metrics(make_engine: MakeEngine) -> None:
    p, d = make_engine(KvRole.PRODUCER), make_engine(KvRole.CONSUMER)
    tokens, tid = prompt(40, 3), "t-stats"
    d.add("d1", tokens, 2, d_params(p, tid))
    p.add("p1", tokens, 1, p_params(tid))
    run([p, d], lambda: p.gone("p1") and d.gone("d1"), "the transfer")

    on_p, on_d = p.worker.step_stats(), d.worker.step_stats()
    assert on_p is not None and on_d is not None
    assert on_p["counts"]["transfers"] == 1
    assert on_p["counts"]["bytes"] == 3 * BLOCK_BYTES  # 40 tokens: three 16-token blocks, the last partial
    assert len(on_p["transfer_s"]) == 1 and 0 < on_p["transfer_s"][0] < 60
    assert on_p["transfer_bytes"] == [3 * BLOCK_BYTES]
    assert "transfers" not in on_d["counts"]  # in push mode P posts the writes: D counts none
    assert on_d["counts"]["handshakes:notif_only"] == 1 and on_p["counts"]["handshakes:full"] == 1
    assert p.worker.step_stats() is None  # a step that did nothing carries nothing

    # A client's malformed kv_transfer_params: D prefills locally; its scheduler counts it, and vLLM's
    # scheduler takes the count after the step (Scheduler.update_from_output asks the connector).
    asked: list[KvwireStats | None] = []
    ask = d.sched.connector.get_kv_connector_stats
    d.sched.connector.get_kv_connector_stats = lambda: asked.append(ask()) or asked[-1]
    d.add("bad", prompt(20, 4), 1, {"do_remote_prefill": True, "remote_host": 7})
    run([d], lambda: d.gone("bad"), "the local prefill")
    from_sched = next(s for s in asked if s is not None)
    assert from_sched.data["counts"] == {"rejected_params": 1}
    assert [s for s in asked if s is not None] == [from_sched]  # told once

    # As vLLM: workers' stats summed in the engine core, logged per interval, exported by the API server.
    summed = (
        KvwireConnector.build_kv_connector_stats(on_p)
        .aggregate(KvwireConnector.build_kv_connector_stats(on_d))
        .aggregate(from_sched)
    )
    logged: list[str] = []
    logging_ = KVConnectorLogging(p.sched.vllm_config.kv_transfer_config)
    logging_.observe(summed.data)
    logging_.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
    assert len(logged) == 1 and "transfers=1" in logged[0] and "rejected_params=1" in logged[0], logged

    registry = CollectorRegistry()
    prom = _prom(registry, p.sched.vllm_config)
    prom.observe(summed.data, 0)
    prom.observe(KvwireConnector.build_kv_connector_stats(on_p).data, 0)  # a second interval adds up
    text = generate_latest(registry).decode()
    assert _sample(text, "vllm:kvwire_transfers_total") == 2
    assert _sample(text, "vllm:kvwire_transfer_bytes_total") == 6 * BLOCK_BYTES
    assert _sample(text, "vllm:kvwire_rejected_params_total") == 1
    assert _sample(text, "vllm:kvwire_transfer_seconds_count") == 2
    # D dialled P (notif-only) and P dialled D back for its writes (full): P's counted twice above.
    assert 'vllm:kvwire_handshakes_total{engine="0",mode="notif_only",model_name="tiny"} 1.0' in text
    assert 'vllm:kvwire_handshakes_total{engine="0",mode="full",model_name="tiny"} 2.0' in text
    p.assert_clean()
    d.assert_clean()
