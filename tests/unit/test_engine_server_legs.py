"""The engine server's legs in process: P and D servers wired by the loopback hooks or the real connector
on the in-process backend, a decode leg whose P is unreachable or never comes, clients that hang up."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from engine_server_env import MODEL, TINY, make_server, reference
from prometheus_client.parser import text_string_to_metric_families

from kvwire.engine.config import EngineConfig, Role
from kvwire.engine.engine import Engine
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.server import EngineServer, Identity
from kvwire.errors import KvwireError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Client = httpx.AsyncClient


@contextlib.asynccontextmanager
async def pd_clients(
    p: EngineServer, d: EngineServer
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """P and D started, an HTTP client on each (in process); both stopped after."""
    p.start()
    d.start()
    try:
        pt, dt = httpx.ASGITransport(app=p.app), httpx.ASGITransport(app=d.app)
        async with (
            httpx.AsyncClient(transport=pt, base_url="http://p") as pc,
            httpx.AsyncClient(transport=dt, base_url="http://d") as dc,
        ):
            yield pc, dc
    finally:
        p.stop()
        d.stop()


async def test_disaggregated_legs_over_http(caplog: pytest.LogCaptureFixture) -> None:
    """P and D servers in one process, wired by the loopback hooks: D's answer equals colocated; each
    leg's debug lines carry the transfer id."""
    caplog.set_level(logging.DEBUG, logger="kvwire.engine.server")
    hub = LoopbackHub()
    p, d = make_server(Role.PREFILL), make_server(Role.DECODE)
    p.engine.set_hooks(hub.producer(p.engine.kv))
    d.engine.set_hooks(hub.consumer(d.engine.kv))
    async with pd_clients(p, d) as (pc, dc):
        prompt = "disaggregate this prompt, please"
        decode_params = {
            "do_remote_prefill": True,
            "transfer_id": "tx1",
            "remote_engine_id": "prefill-test",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_tp_size": 1,
            "remote_pp_size": 1,
        }
        d_body = {
            "prompt": prompt,
            "max_tokens": 6,
            "ignore_eos": True,
            "kv_transfer_params": decode_params,
        }
        p_params = {"do_remote_decode": True, "transfer_id": "tx1"}
        p_body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": p_params}
        rd, rp = await asyncio.gather(
            dc.post("/v1/completions", json=d_body), pc.post("/v1/completions", json=p_body)
        )
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        kvp = rp.json()["kv_transfer_params"]
        assert kvp["transfer_id"] == "tx1" and kvp["remote_engine_id"] == "prefill-test"
        # P's answer is D's leg as it is (vllm-router and vLLM's proxies hand it over unchanged)
        assert (kvp["do_remote_prefill"], kvp["do_remote_decode"]) == (True, False)
        assert kvp["num_tokens"] == len(prompt) + 1
        got = rd.json()
        assert got["choices"][0]["token_ids"] == reference(prompt, 6)
        assert got["timings"]["kv_bytes"] == 3 * 16 * TINY.kv_spec().bytes_per_token()
        assert got["timings"]["kv_transfer_ms"] >= 0
        traced = [r.getMessage() for r in caplog.records if getattr(r, "transfer_id", None) == "tx1"]
        assert sum("accepted" in m for m in traced) == 2 and sum("done" in m for m in traced) == 2


async def test_disaggregated_with_the_real_connector_inproc() -> None:
    """P (tp 2, pp 2) and D (tp 1) servers with kvwire's Producer/Consumer on the in-process transport."""
    from kvwire.engine.connector_hooks import ConnectorMetrics, ConnectorSettings, attach_connector

    servers = {}
    for role, tp, pp in ((Role.PREFILL, 2, 2), (Role.DECODE, 1, 1)):
        eng = Engine(EngineConfig(TINY, role=role, tp_size=tp, pp_size=pp, num_blocks=64), model=MODEL)
        eid = f"{role.value}-real"
        hooks = attach_connector(eng, ConnectorSettings(eid, "inc1", "kvwire-tiny", backend="inproc"))
        srv = EngineServer(eng, Identity(role, eid, "inc1", "127.0.0.1", hooks.connector.port))
        srv.scrape_hooks.append(ConnectorMetrics(hooks.connector, srv.metrics).sync)
        servers[role] = srv
    p, d = servers[Role.PREFILL], servers[Role.DECODE]
    async with pd_clients(p, d) as (pc, dc):
        for i, prompt in enumerate(["short", "a longer prompt " * 9]):
            tid = f"real{i}"
            dparams = {
                "do_remote_prefill": True,
                "transfer_id": tid,
                "remote_engine_id": "prefill-real",
                "remote_host": "127.0.0.1",
                "remote_port": p.identity.side_channel_port,
                "remote_tp_size": 2,
                "remote_pp_size": 2,
            }
            d_body = {
                "prompt": prompt,
                "max_tokens": 5,
                "ignore_eos": True,
                "kv_transfer_params": dparams,
            }
            p_body = {
                "prompt": prompt,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
            }
            rd, rp = await asyncio.gather(
                dc.post("/v1/completions", json=d_body), pc.post("/v1/completions", json=p_body)
            )
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            assert rd.json()["choices"][0]["token_ids"] == reference(prompt, 5)
        stats = (await pc.get("/v1/kv_stats")).json()
        # 2 requests x 4 P ranks, each one push; D counts none (the poster counts)
        assert stats["transfers"] == 8 and stats["bytes"] > 0
        assert {h["notif_only"] for h in stats["handshakes"]} == {False}
        d_stats = (await dc.get("/v1/kv_stats")).json()
        assert d_stats["transfers"] == 0 and {h["notif_only"] for h in d_stats["handshakes"]} == {True}
        # D posts nothing in push mode, but says how long each request waited for its KV.
        waits = [
            s.value
            for f in text_string_to_metric_families((await dc.get("/metrics")).text)
            for s in f.samples
            if s.name == "kvwire_kv_wait_seconds_count"
        ]
        assert waits == [2.0]
        for c in (pc, dc):
            assert (await c.get("/health")).json()["load"]["free_blocks"] == 64


async def test_decode_leg_fails_with_503_when_the_prefiller_is_unreachable() -> None:
    from kvwire.connector import ConnectorConfig
    from kvwire.engine.connector_hooks import ConnectorSettings, attach_connector

    eng = Engine(EngineConfig(TINY, role=Role.DECODE, num_blocks=64), model=MODEL)
    cfg = ConnectorConfig(handshake_timeout_s=0.2, handshake_retries=0)
    hooks = attach_connector(eng, ConnectorSettings("dec", "inc1", "m", backend="inproc", config=cfg))
    srv = EngineServer(eng, Identity(Role.DECODE, "dec", "inc1", "127.0.0.1", hooks.connector.port))
    srv.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://d") as dc:
            dparams = {
                "do_remote_prefill": True,
                "transfer_id": "lost",
                "remote_engine_id": "nobody",
                "remote_host": "127.0.0.1",
                "remote_port": 9,  # discard: nothing listens
            }
            r = await dc.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": dparams})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "kv_load_failed"
            for _ in range(100):  # the blocks come back once the connector releases them
                if (await dc.get("/health")).json()["load"]["free_blocks"] == 64:
                    break
                await asyncio.sleep(0.05)
            assert (await dc.get("/health")).json()["load"]["free_blocks"] == 64
    finally:
        srv.stop()


def _post_until_hung_up(
    app: Any, body: bytes
) -> tuple[asyncio.Task[None], list[dict[str, object]], asyncio.Event]:
    """POST ``body`` to ``/v1/completions`` of ``app`` as raw ASGI, from a client that stays until ``gone``
    is set, then hangs up: (the request's task, the messages sent back, ``gone``)."""
    sent: list[dict[str, object]] = []
    gone = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}  # fmt: skip
    return asyncio.create_task(app(scope, receive, send)), sent, gone


async def test_orphaned_decode_leg_releases_its_blocks_when_the_client_goes_away() -> None:
    """A decode leg whose P never comes (or whose client hung up) must not pin D's blocks until the fence:
    the server notices the disconnect while waiting and aborts the request."""
    hub = LoopbackHub()
    d = make_server(Role.DECODE, num_blocks=64)
    d.engine.set_hooks(hub.consumer(d.engine.kv))
    d.start()
    params = {"do_remote_prefill": True, "transfer_id": "orphan", "remote_engine_id": "prefill-test",
              "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 4, "kv_transfer_params": params}).encode()
    try:
        leg, sent, gone = _post_until_hung_up(d.app, body)
        for _ in range(100):
            if d.health()["load"]["free_blocks"] < 64:
                break
            await asyncio.sleep(0.02)
        assert d.health()["load"]["free_blocks"] < 64, "the decode leg never allocated its blocks"
        gone.set()  # the client hangs up
        await asyncio.wait_for(leg, 5)
        assert sent and sent[0]["status"] == 499
        for _ in range(100):
            if d.health()["load"]["free_blocks"] == 64:
                break
            await asyncio.sleep(0.02)
        assert d.health()["load"]["free_blocks"] == 64
    finally:
        d.stop()


async def test_side_channel_evictions_are_exported_in_metrics() -> None:
    import socket

    from kvwire.engine.connector_hooks import ConnectorMetrics, ConnectorSettings, attach_connector

    eng = Engine(EngineConfig(TINY, role=Role.PREFILL, num_blocks=16), model=MODEL)
    hooks = attach_connector(eng, ConnectorSettings("prefill-guard", "inc1", "kvwire-tiny", backend="inproc"))
    srv = EngineServer(
        eng, Identity(Role.PREFILL, "prefill-guard", "inc1", "127.0.0.1", hooks.connector.port)
    )
    srv.scrape_hooks.append(ConnectorMetrics(hooks.connector, srv.metrics).sync)
    srv.start()
    socks = [socket.create_connection(("127.0.0.1", hooks.connector.port)) for _ in range(40)]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://p") as c:
            for _ in range(100):  # the listener runs on the connector's loop thread: wait for it
                text = (await c.get("/metrics")).text
                got = {
                    s.labels.get("reason"): s.value
                    for f in text_string_to_metric_families(text)
                    if f.name == "kvwire_refused_connections"
                    for s in f.samples
                }
                if got.get("evicted_idle", 0) >= 8:
                    break
                await asyncio.sleep(0.05)
            assert got.get("evicted_idle", 0) >= 8, got
    finally:
        for s in socks:
            s.close()
        srv.stop()


async def test_kv_transfer_params_need_the_router_token_when_one_is_set() -> None:
    engine = Engine(EngineConfig(TINY, num_blocks=64), model=MODEL)
    server = EngineServer(engine, Identity(Role.COLOCATED, "c", "inc0"), router_token="t0k3n")
    server.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://e") as c:
            params = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": False}}
            for headers in ({}, {"x-kvwire-router-token": "wrong"}):
                r = await c.post("/v1/completions", json=params, headers=headers)
                assert r.status_code == 403, r.text
                error = r.json()["error"]
                assert error["type"] == "permission_error" and error["param"] == "kv_transfer_params"
            ok = await c.post("/v1/completions", json=params, headers={"x-kvwire-router-token": "t0k3n"})
            assert ok.status_code == 200, ok.text
            plain = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert plain.status_code == 200  # a request without kv_transfer_params needs no token
    finally:
        server.stop()


async def test_side_channel_refusals_and_failed_handshakes_are_exported_in_metrics() -> None:
    """Malformed side-channel requests (or probes for the secret) and this engine's failed handshakes
    were counted in ``ServerStats.replies`` and the managers' stats, never in ``/metrics``."""
    import socket

    from kvwire.engine.connector_hooks import ConnectorMetrics, ConnectorSettings, attach_connector
    from kvwire.testing.procs import free_port
    from kvwire.transport.base import PeerMode

    eng = Engine(EngineConfig(TINY, role=Role.PREFILL, num_blocks=16), model=MODEL)
    settings = ConnectorSettings("prefill-refusals", "inc1", "kvwire-tiny", backend="inproc")
    hooks = attach_connector(eng, dataclasses.replace(settings, config=dataclasses.replace(
        settings.config, handshake_retries=0)))  # fmt: skip
    srv = EngineServer(
        eng, Identity(Role.PREFILL, "prefill-refusals", "inc1", "127.0.0.1", hooks.connector.port)
    )
    srv.scrape_hooks.append(ConnectorMetrics(hooks.connector, srv.metrics).sync)
    srv.start()
    try:
        for _ in range(3):  # a frame whose body is a msgpack array, not a map: bad_request
            with socket.create_connection(("127.0.0.1", hooks.connector.port)) as s:
                s.sendall(b"\x00\x00\x00\x03\x92\x01\x02")
                s.recv(4096)
        mgr = hooks.connector.managers[(0, 0)]
        bg = hooks.connector.background_loop
        assert bg is not None
        with pytest.raises(KvwireError):
            bg.run(mgr.ensure("127.0.0.1", free_port(), 0, 0, PeerMode.NOTIF_ONLY), 10)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://p") as c:
            families = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        refusals = {s.labels["reason"]: s.value for s in families["kvwire_side_channel_refusals"].samples
                    if s.name.endswith("_total")}  # fmt: skip
        failures = {s.labels["reason"]: s.value for s in families["kvwire_handshake_failures"].samples
                    if s.name.endswith("_total")}  # fmt: skip
        assert refusals == {"bad_request": 3.0}, refusals
        assert sum(failures.values()) == 1.0 and failures.get("unreachable") == 1.0, failures
    finally:
        srv.stop()


async def test_a_prompt_token_out_of_the_vocabulary_names_the_prompt() -> None:
    engine = Engine(EngineConfig(TINY, num_blocks=16), model=MODEL)
    server = EngineServer(engine, Identity(Role.COLOCATED, "c", "i"))
    server.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://e") as c:
            r = await c.post("/v1/completions", json={"prompt": [1, -5], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    finally:
        server.stop()


async def test_a_decode_leg_for_another_prompt_than_p_prefilled_is_refused() -> None:
    """P's answer names its prompt's length (``num_tokens``): a D leg with a longer prompt would read (pull)
    slots P never wrote for it, as KV; a shorter one a prefix of another prompt's."""
    engine = Engine(EngineConfig(TINY, role=Role.DECODE, num_blocks=16), model=MODEL)
    server = EngineServer(engine, Identity(Role.DECODE, "d", "i"))
    server.start()
    leg = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "P", "remote_host": "127.0.0.1",
           "remote_port": 1, "num_tokens": 4}  # fmt: skip
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://e") as c:
            r = await c.post("/v1/completions", json={"prompt": "abcdefgh", "kv_transfer_params": leg})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(
            "kv_transfer_params: P prefilled 4 tokens, this prompt"
        )
        assert engine.kv.allocator.num_free == 16  # refused before any block was taken
    finally:
        server.stop()


async def test_a_client_that_hangs_up_on_a_long_unary_answer_stops_its_generation() -> None:
    """The disconnect was checked only while no output came: a client that left a 2,500-token unary
    answer after 1.5 s still cost its whole 10 s generation."""
    srv = make_server(Role.COLOCATED, num_blocks=256)
    srv.start()
    body = json.dumps({"prompt": "x", "max_tokens": 4000, "ignore_eos": True}).encode()
    try:
        leg, sent, gone = _post_until_hung_up(srv.app, body)
        await asyncio.sleep(0.3)  # generating
        gone.set()  # the client hangs up
        started = time.monotonic()
        await asyncio.wait_for(leg, 5)
        assert sent and sent[0]["status"] == 499
        assert time.monotonic() - started < 1.0
        for _ in range(50):  # the engine let the request go: nothing left running
            if srv.engine.scheduler.num_active == 0:
                break
            await asyncio.sleep(0.02)
        assert srv.engine.scheduler.num_active == 0
        # Counted as the router counts it (engines counted no request whose client left).
        text = await _metrics_text(srv)
        assert (
            'kvwire_requests_total{model_name="kvwire-tiny",outcome="cancelled",role="colocated"} 1.0' in text
        )
    finally:
        srv.stop()


async def _metrics_text(srv: Any) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://e") as c:
        return (await c.get("/metrics")).text
