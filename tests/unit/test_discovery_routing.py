"""The fleet's routing pieces without etcd: the registry following discovered records (join, leave,
drain, new life), the prefix index, and the prefix-aware score. ``-k "etcd or discovery"`` finds them."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import msgspec
import pytest

from kvwire.config import EngineKind, Policy, RouterConfig
from kvwire.discovery.record import EngineRecord, FleetRole, RecordLoad
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.fleet import health_info
from kvwire.router.http import EngineClient
from kvwire.router.policy import QUEUE_TOKENS, EngineView, Load, Picker, Role, prefill_cost
from kvwire.router.prefix import BLOCK_TOKENS, PrefixIndex, block_hashes

P1, P2, D1 = "http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9201"


def info(role: Role, incarnation: str = "a", free: int = 10) -> HealthInfo:
    rec = EngineRecord(
        role=FleetRole(role.value), engine_id=f"{role.value}-x", incarnation=incarnation, model="m",
        url="u", side_channel_host="127.0.0.1", side_channel_port=1, load=RecordLoad(free_blocks=free),
    )  # fmt: skip
    return health_info(rec)


def registry() -> EngineRegistry:
    client = EngineClient(1.0, 1.0, None)
    return EngineRegistry(client, [], [], 1.0)


def test_discovery_registry_follows_joins_leaves_and_drains() -> None:
    reg = registry()
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL), (Role.DECODE, D1): info(Role.DECODE)}, {})
    assert [v.url for v in reg.views(Role.PREFILL) if v.healthy] == [P1]
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL), (Role.DECODE, D1): info(Role.DECODE)}, {P1: True})
    assert [v.healthy for v in reg.views(Role.PREFILL)] == [False]  # draining: not chosen
    assert reg.engines[Role.PREFILL][0].summary()["draining"] is True
    reg.begin(P1)  # a request is still on it when its record goes
    reg.sync({(Role.DECODE, D1): info(Role.DECODE)}, {})
    assert reg.views(Role.PREFILL) == []
    reg.end(P1)  # the request ends: the departed engine is forgotten (the table stays bounded)
    with pytest.raises(KeyError):
        reg.get(P1)
    reg.suspect(P1)  # a late leg failure for a departed engine is not an error


def test_discovery_new_life_is_healthy_and_its_prefix_index_empty() -> None:
    reg = registry()
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL, "a")}, {})
    state = reg.get(P1)
    state.healthy = False  # its health check failed: killed
    reg.prefix.record(P1, block_hashes("x" * 64))
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL, "a")}, {})
    assert not state.healthy  # a record refresh of the same life does not revive it
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL, "b")}, {})
    assert state.healthy and state.info is not None and state.info.incarnation == "b"
    assert reg.prefix.size(P1) == 0  # the new life's cache is empty


def test_discovery_vllm_identity_follows_the_record_through_health_polls() -> None:
    """A vLLM engine restarted on the same URL: its new record's identity holds, and /health (which says
    nothing of kvwire) only refreshes health and the served name; it never brings back the old life."""
    reg = EngineRegistry(_Canned(), [], [], 1.0, EngineKind("vllm"))
    life1 = dataclasses.replace(info(Role.PREFILL, "life1"), side_channel_port=5600, model="compat-id")
    life2 = dataclasses.replace(info(Role.PREFILL, "life2"), side_channel_port=5700, model="compat-id")
    reg.sync({(Role.PREFILL, P1): life1}, {})
    reg.sync({(Role.PREFILL, P1): life2}, {})
    state = reg.get(P1)
    reg.prefix.record(P1, block_hashes("x" * 64))
    asyncio.run(reg.check(state))
    assert state.healthy and state.info is not None
    assert (state.info.incarnation, state.info.side_channel_port) == ("life2", 5700)
    assert state.info.model == "served-name"  # /v1/models', not the record's compat id
    assert reg.prefix.size(P1) == 4  # no "new life" seen by the poll: the index stays
    reg.sync({(Role.PREFILL, P1): life2}, {})  # the same life's record again keeps the served name
    assert state.info.model == "served-name" and reg.models() == {"served-name"}


class _Canned(EngineClient):
    """A vLLM engine's /health and /v1/models, without sockets."""

    def __init__(self) -> None:
        super().__init__(1.0, 1.0, None)

    async def get(self, url: str, timeout_s: float, api_key: bool = False) -> tuple[int, bytes]:
        body = {"data": [{"id": "served-name"}]} if url.endswith("/v1/models") else {}
        return 200, json.dumps(body).encode()


def test_discovery_departure_and_role_change_keep_counts_sane() -> None:
    reg = registry()
    reg.sync({(Role.PREFILL, P1): info(Role.PREFILL)}, {})
    reg.begin(P1)
    reg.sync({(Role.DECODE, P1): info(Role.DECODE)}, {})  # the same URL comes back as a decode engine
    reg.end(P1)  # the request sent to it as P ends
    assert reg.get(P1).inflight == 0 and reg.get(P1).role is Role.DECODE
    reg.sync({}, {})  # it leaves: a late leg's bookkeeping neither raises nor re-creates its index
    reg.begin(P1)
    reg.end(P1)
    reg.prefix_sent(P1, block_hashes("y" * 64))
    assert reg.prefix.size(P1) == 0 and not reg.in_view(P1)
    assert asyncio.run(reg.info_of(P1)) is None


def test_discovery_block_hashes_chain_and_index_is_bounded() -> None:
    a = block_hashes("s" * 40 + "tail-a")
    b = block_hashes("s" * 40 + "tail-b")
    assert len(a) == 46 // BLOCK_TOKENS == 2
    assert a[:2] == b[:2]  # the same 32 leading bytes
    assert block_hashes("x" + "s" * 40)[1] != a[1]  # block 1 differs when block 0 does (chained)
    assert block_hashes([1, 2, 3] * 16) == block_hashes([1, 2, 3] * 16)
    index = PrefixIndex(capacity=4)
    index.record(P1, block_hashes("q" * 16 * 6))
    assert index.size(P1) == 4  # bounded: 4 blocks kept
    assert index.overlap(P1, block_hashes("q" * 16 * 6)) == 4  # the head 4: the tail was evicted
    index.record(P2, a)
    assert index.overlap(P2, b) == 2 and index.overlap(P2, block_hashes("z" * 64)) == 0


def test_discovery_prefix_aware_score() -> None:
    """P: fewest prompt tokens to compute before this one (queued + uncached + 16 per busy request);
    D: least loaded. A cache hit wins until the hit engine's queue outweighs it."""
    hot = EngineView(P1, True)
    cold = EngineView(P2, True)
    picker = Picker(Policy.PREFIX_AWARE)
    cached = {P1: 512}
    assert picker.pick(Role.PREFILL, [cold, hot], cached, 600).url == P1
    assert prefill_cost(hot, 512, 600) == 88 and prefill_cost(cold, 0, 600) == 600
    busy_hot = EngineView(P1, True, prefill_tokens=400, load=Load(running=2))
    assert prefill_cost(busy_hot, 512, 600) == 400 + 88 + 2 * QUEUE_TOKENS
    assert picker.pick(Role.PREFILL, [cold, busy_hot], cached, 600).url == P1  # 520 < 600
    busier = EngineView(P1, True, prefill_tokens=600)
    assert picker.pick(Role.PREFILL, [cold, busier], cached, 600).url == P2  # 688 > 600
    # Equal costs rotate; unhealthy engines are never picked.
    got = {picker.pick(Role.PREFILL, [cold, hot], {}, 100).url for _ in range(4)}
    assert got == {P1, P2}
    assert picker.pick(Role.PREFILL, [EngineView(P1, False), cold], cached, 600).url == P2
    # D: the fewest requests, then the most free blocks.
    d_busy = EngineView("d1", True, Load(running=3, free_blocks=900))
    d_full = EngineView("d2", True, Load(running=1, free_blocks=10))
    d_free = EngineView("d3", True, Load(running=1, free_blocks=500))
    assert picker.pick(Role.DECODE, [d_busy, d_full, d_free]).url == "d3"
    # Round robin ignores the cache.
    rr = Picker(Policy.ROUND_ROBIN)
    assert [rr.pick(Role.PREFILL, [hot, cold], cached, 600).url for _ in range(2)] == [P1, P2]


def test_discovery_prefix_index_overlaps_every_engine_at_once() -> None:
    index = PrefixIndex()
    long_a = block_hashes("a" * 16 * 8)
    index.record(P1, long_a)
    index.record(P2, long_a[:3])
    index.record(D1, block_hashes("b" * 64))
    assert index.overlaps(long_a) == {P1: 8, P2: 3}
    assert index.overlaps(block_hashes("c" * 64)) == {}
    index.set_capacity(P1, 2)  # the engine's cache is 2 blocks: the tail goes, the head stays
    assert index.size(P1) == 2 and index.overlaps(long_a) == {P1: 2, P2: 3}
    index.forget(P2)  # its holders go with it
    assert index.overlaps(long_a) == {P1: 2}
    assert index._holders.keys() == set(block_hashes("b" * 64)) | set(long_a[:2])


def test_discovery_prefix_index_evicts_the_tail_of_a_prompt_first() -> None:
    """A lookup needs block 0: at capacity the least recent prompt loses its tail, not its head."""
    index = PrefixIndex(capacity=8)
    a, b = block_hashes("a" * 16 * 6), block_hashes("b" * 16 * 6)
    index.record(P1, a)
    index.record(P1, b)
    assert index.size(P1) == 8
    assert index.overlap(P1, b) == 6  # the most recent prompt whole
    assert index.overlap(P1, a) == 2  # the older one still matches on its head
    index.record(P1, a[:1])  # a shared head used again is kept over the others' tails
    index.record(P1, block_hashes("c" * 16 * 7))
    assert index.overlap(P1, a) == 1


def test_discovery_token_ids_of_any_size_hash() -> None:
    """A client's token id is not the router's to judge: any int hashes (the engine refuses what it must)."""
    big = block_hashes([2**32] * 16)
    assert len(big) == 1 and big != block_hashes([0] * 16)
    assert block_hashes([2**70, 1] * 8) != block_hashes([2**6, 1] * 8)
    assert block_hashes([1, 23] * 8) != block_hashes([12, 3] * 8)  # ids are delimited


def test_discovery_target_and_record_parsing() -> None:
    from kvwire.discovery.etcd import EtcdUnavailable, _events, parse_target, prefix_end
    from kvwire.discovery.record import MAX_RECORD_BYTES, decode, encode
    from kvwire.errors import ConfigError

    assert parse_target("etcd://10.0.0.5:2379/prod/") == parse_target("etcd://10.0.0.5:2379/prod")
    t = parse_target("etcd://h")
    assert (t.host, t.port, t.prefix, str(t)) == ("h", 2379, "/kvwire", "etcd://h:2379/kvwire")
    v6 = parse_target("etcd://[::1]:2380/p")  # an IPv6 literal keeps its brackets in the URL it dials
    assert (v6.host, v6.base_url, str(v6)) == ("::1", "http://[::1]:2380", "etcd://[::1]:2380/p")
    for bad in ("http://h:1", "etcd://", "etcd://h:port"):
        with pytest.raises(ConfigError):
            parse_target(bad)
    assert prefix_end("/kvwire/engines/") == "/kvwire/engines0"
    rec = EngineRecord(FleetRole.DECODE, "d", "i", "m", "http://x:1", "x", 2)
    assert decode(encode(rec)) == rec
    for raw in (b"{}", b"[1]", b'{"role": "router"}', b" " * (MAX_RECORD_BYTES + 1)):
        with pytest.raises(ValueError):
            decode(raw)
    # Out of the bounds /health is held to: refused on decode, as the watcher's skip-and-count expects.
    good = msgspec.json.decode(encode(rec))
    for field, value in (("side_channel_port", 99999), ("tp_size", 0), ("pp_size", -4)):
        with pytest.raises(ValueError, match=field):
            decode(msgspec.json.encode({**good, field: value}))
    with pytest.raises(ValueError, match="running"):
        decode(msgspec.json.encode({**good, "load": {"running": -1}}))
    with pytest.raises(EtcdUnavailable):
        _events({"error": {"message": "no"}})
    with pytest.raises(EtcdUnavailable):
        _events({"result": {"canceled": True, "compact_revision": "5"}})
    assert (
        _events({"result": {"events": [{"type": "DELETE", "kv": {"key": "YQ==", "mod_revision": "3"}}]}})[
            0
        ].value
        is None
    )


def test_discovery_router_options_need_no_urls() -> None:
    import argparse

    from kvwire.errors import ConfigError
    from kvwire.options import Command
    from kvwire.router.cli import config_from_values
    from kvwire.serve import add_arguments_for, values_for

    def config(*argv: str) -> RouterConfig:
        parser = argparse.ArgumentParser()
        add_arguments_for(parser, "serve router")
        values = values_for(parser.parse_args(list(argv)), Command.ROUTER, {})
        return config_from_values(values)

    cfg = config("--discovery", "etcd://127.0.0.1:2379/f", "--policy", "prefix_aware")
    assert cfg.prefill_urls == () and cfg.discovery == "etcd://127.0.0.1:2379/f"
    assert cfg.policy is Policy.PREFIX_AWARE
    with pytest.raises(ConfigError, match="--discovery"):
        config()
    with pytest.raises(ConfigError, match="etcd://"):
        config("--discovery", "127.0.0.1:2379")


def test_discovery_router_health_counts_draining_engines_out() -> None:
    from kvwire.router.app import Router

    router = Router(RouterConfig((), (), discovery="etcd://127.0.0.1:1"))
    router.registry.sync({(Role.PREFILL, P1): info(Role.PREFILL), (Role.DECODE, D1): info(Role.DECODE)}, {})
    assert router.health()[0] == 200
    router.registry.sync(
        {(Role.PREFILL, P1): info(Role.PREFILL), (Role.DECODE, D1): info(Role.DECODE)}, {P1: True}
    )
    status, body = router.health()
    assert status == 503 and body["status"] == "unavailable" and body["prefill"][0]["draining"]
