"""config.py (environment, URLs, validation) and metrics.py (registry per server, stats updates)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwire.config import RouterConfig, env_config, normalize_url, split_urls
from kvwire.errors import ConfigError
from kvwire.metrics import BlockStats, HandshakeStats, KvMetrics, Outcome, TransferStats
from kvwire.protocol.messages import FailReason, TransferMode
from kvwire.transport.base import PeerMode
from kvwire_tools.demo.config import DemoConfig


def test_env_config_reads_only_the_given_mapping() -> None:
    env = env_config(
        {"KVWIRE_SECRET": "s3", "KVWIRE_SIDE_CHANNEL_HOST": "10.1.2.3", "KVWIRE_LOG_LEVEL": "DEBUG"}
    )
    assert (env.secret, env.side_channel_host, env.log_level) == (b"s3", "10.1.2.3", "debug")
    empty = env_config({"KVWIRE_SECRET": ""})
    assert (empty.secret, empty.side_channel_host, empty.log_level) == (None, None, "info")
    with pytest.raises(ConfigError):
        env_config({"KVWIRE_LOG_LEVEL": "loud"})


def test_urls_are_normalized_split_and_deduplicated() -> None:
    assert normalize_url("host:8000/") == "http://host:8000"
    assert split_urls(["a:1,b:2", "http://c:3"]) == ("http://a:1", "http://b:2", "http://c:3")
    with pytest.raises(ConfigError):
        split_urls(["a:1", "http://a:1"])
    with pytest.raises(ConfigError):
        normalize_url(" ")
    with pytest.raises(ConfigError):
        normalize_url("ftp://x")


def test_router_and_demo_configs_validate() -> None:
    with pytest.raises(ConfigError):
        RouterConfig(prefill_urls=(), decode_urls=("http://d",))
    with pytest.raises(ConfigError):
        RouterConfig(prefill_urls=("http://x",), decode_urls=("http://x",))
    with pytest.raises(ConfigError):
        RouterConfig(prefill_urls=("http://p",), decode_urls=("http://d",), request_timeout_s=0)
    with pytest.raises(ConfigError):
        DemoConfig(requests=0)
    with pytest.raises(ConfigError):
        DemoConfig(min_prompt_tokens=100, max_prompt_tokens=10)


def _samples(m: KvMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by name and labels, less the role and model_name every sample carries (checked here)."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert (labels.pop("role"), labels.pop("model_name")) == (m.role.value, m.model_name)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_metrics_update_from_stats_and_render() -> None:
    m = KvMetrics()
    m.record_transfer(TransferStats(TransferMode.PUSH, num_bytes=4096, seconds=0.002))
    m.record_transfer(TransferStats(TransferMode.PUSH, num_bytes=1000, seconds=0.5, ok=False,
                                    reason=FailReason.WRITE_FAILED))  # fmt: skip
    m.record_handshake(HandshakeStats("P0 tp0", PeerMode.NOTIF_ONLY, 0.004))
    m.record_handshake(HandshakeStats("D0 tp0", PeerMode.FULL, 0.080))
    m.record_failure(FailReason.FENCE_EXPIRED)
    m.set_blocks(BlockStats(in_use=7, quarantined=2, total=100))
    m.record_request(Outcome.OK, 0.3, ttft_s=0.1)
    s = _samples(m)
    assert s[("kvwire_transfers_total", (("mode", "push"), ("outcome", "ok")))] == 1
    assert s[("kvwire_transfers_total", (("mode", "push"), ("outcome", "failed")))] == 1
    assert s[("kvwire_transfer_bytes_total", (("mode", "push"),))] == 4096
    assert s[("kvwire_transfer_size_bytes_sum", (("mode", "push"),))] == 4096  # one successful transfer
    assert s[("kvwire_transfer_size_bytes_count", (("mode", "push"),))] == 1
    assert s[("kvwire_handshakes_total", (("mode", "notif_only"),))] == 1
    assert s[("kvwire_handshakes_total", (("mode", "full"),))] == 1
    assert s[("kvwire_failures_total", (("reason", "write_failed"),))] == 1
    assert s[("kvwire_failures_total", (("reason", "fence_expired"),))] == 1
    assert s[("kvwire_blocks_in_use", ())] == 7 and s[("kvwire_blocks_quarantined", ())] == 2
    assert s[("kvwire_requests_total", (("outcome", "ok"),))] == 1
    snap = m.snapshot()
    assert (snap["transfers"], snap["failed_transfers"], snap["bytes"]) == (1, 1, 4096)
    assert snap["gbps"] == pytest.approx(4096 / 0.002 / 1e9)
    assert snap["handshakes"] == [
        {"peer": "P0 tp0", "notif_only": True, "ms": pytest.approx(4.0)},
        {"peer": "D0 tp0", "notif_only": False, "ms": pytest.approx(80.0)},
    ]
    assert (snap["blocks_in_use"], snap["blocks_quarantined"]) == (7, 2)


def test_each_server_gets_its_own_registry() -> None:
    a, b = KvMetrics(), KvMetrics()
    a.record_request(Outcome.TIMEOUT, 1.0)
    assert ("kvwire_requests_total", (("outcome", "timeout"),)) not in _samples(b)
    assert KvMetrics().snapshot()["gbps"] is None
