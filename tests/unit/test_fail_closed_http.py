"""Fail closed through the real engines (issue 20): P and D servers with kvwire's Producer and Consumer on
the in-process transport, D checking digests. Each broken peer below used to get HTTP 200 with tokens
that differ from the colocated answer; now the decode leg answers an OpenAI-shaped error, and a correct
request on the same engines still matches the colocated reference.

The broken peers are kvwire's own cores with one rule removed (patched for the test): P sends ``done``
without writing (as a foreign P did), P sends an old peer's ``done`` (no statement), D registers fewer
tokens than the prompt, and a client reuses a transfer id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

import kvwire.core.consumer as consumer_core
from kvwire.connector import ConnectorConfig
from kvwire.core.io import Send
from kvwire.core.producer_push import PushProducerCore
from kvwire.core.producer_records import Reg, Request
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.connector_hooks import (
    ConnectorMetrics,
    ConnectorSettings,
    ConsumerHooks,
    ProducerHooks,
    attach_connector,
)
from kvwire.engine.engine import Engine
from kvwire.engine.model import Model
from kvwire.engine.server import EngineServer, Identity
from kvwire.kv.descriptors import TransferPlan
from kvwire.protocol.messages import Done, PushReg
from kvwire.transport.base import make_agent_name

pytestmark = pytest.mark.anyio

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
PROMPT = "a prompt long enough for a few blocks " * 3
CHECKED = ConnectorConfig(kv_digest_sample=1.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def reference(prompt: str, max_tokens: int) -> list[int]:
    engine = Engine(EngineConfig(TINY, num_blocks=128), model=MODEL)
    return engine.generate([engine.tokenizer.encode(prompt)], max_tokens, ignore_eos=True)[0]


class Servers:
    def __init__(self, d_config: ConnectorConfig) -> None:
        self.servers: dict[Role, EngineServer] = {}
        self.hooks: dict[Role, ProducerHooks | ConsumerHooks] = {}
        for role, cfg in ((Role.PREFILL, ConnectorConfig()), (Role.DECODE, d_config)):
            eng = Engine(EngineConfig(TINY, role=role, num_blocks=64), model=MODEL)
            eid = f"{role.value}-fc"
            settings = ConnectorSettings(eid, "inc1", "kvwire-tiny", backend="inproc", config=cfg)
            hooks = attach_connector(eng, settings)
            srv = EngineServer(eng, Identity(role, eid, "inc1", "127.0.0.1", hooks.connector.port))
            srv.scrape_hooks.append(ConnectorMetrics(hooks.connector, srv.metrics).sync)
            self.servers[role] = srv
            self.hooks[role] = hooks

    async def request(self, tid: str, *, p_leg: bool = True) -> httpx.Response:
        """Both legs of one request (the prefill leg only when ``p_leg``); the decode leg's answer."""
        p = self.servers[Role.PREFILL]
        dparams = {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "prefill-fc",
            "remote_host": "127.0.0.1", "remote_port": p.identity.side_channel_port,
        }  # fmt: skip
        d_body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "kv_transfer_params": dparams}
        p_body = {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        legs: list[Any] = [self.dc.post("/v1/completions", json=d_body)]
        if p_leg:
            legs.append(self.pc.post("/v1/completions", json=p_body))
        answers = await asyncio.gather(*legs)
        return answers[0]  # type: ignore[no-any-return]

    async def metric(self, role: Role, name: str, label: str) -> float:
        text = (await (self.dc if role is Role.DECODE else self.pc).get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name) and f'"{label}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers(CHECKED)
    for srv in s.servers.values():
        srv.start()
    try:
        p, d = s.servers[Role.PREFILL], s.servers[Role.DECODE]
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=p.app), base_url="http://p") as pc,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=d.app), base_url="http://d") as dc,
        ):
            s.pc, s.dc = pc, dc
            yield s
    finally:
        for srv in s.servers.values():
            srv.stop()


def _no_write(stated: bool) -> Any:
    """A P that sends its ``done`` without posting the write (stating what it would have written, or, as
    an old peer, nothing)."""

    def post(self: PushProducerCore, req: Request, reg: Reg, plan: TransferPlan, done: Done) -> None:
        if not stated:
            done = msgspec.structs.replace(done, reg_nonce=0, nbytes=None, digest=None)
        token = self._send(reg.key, reg.sender, done, answer=True)
        self._awaiting[token] = (req, reg, False)

    return post


def assert_kv_error(r: httpx.Response, reason: str, *, permanent: bool = False) -> None:
    """An OpenAI-shaped error naming ``reason``: 503 (a retry may succeed), or 500 with
    ``x-should-retry: false`` when no retry of the same request can."""
    err = r.json()["error"]
    assert reason in err["message"], err
    if permanent:
        assert (r.status_code, err["type"], r.headers["x-should-retry"]) == (
            500,
            "configuration_error",
            "false",
        )
    else:
        assert (r.status_code, err["type"]) == (503, "kv_load_failed"), r.text


async def test_a_correct_request_still_matches_the_colocated_answer(servers: Servers) -> None:
    r = await servers.request("ok-1")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference(PROMPT, 5)


@pytest.mark.parametrize(("stated", "reason"), [(True, "digest_mismatch"), (False, "bad_done")])
async def test_a_done_without_the_write_is_an_error_not_200(
    servers: Servers, monkeypatch: pytest.MonkeyPatch, stated: bool, reason: str
) -> None:
    monkeypatch.setattr(PushProducerCore, "_post_write", _no_write(stated))
    assert_kv_error(await servers.request("nowrite-1"), reason)


async def test_a_reused_transfer_id_is_refused_with_400_naming_it(servers: Servers) -> None:
    assert (await servers.request("dup-1")).status_code == 200
    r = await servers.request("dup-1", p_leg=False)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "kv_transfer_params"
    assert "dup-1" in err["message"]


async def test_a_done_replayed_after_its_request_ended_is_dropped_and_counted(servers: Servers) -> None:
    r = await servers.request("replayed-1")
    assert r.status_code == 200, r.text
    producer = servers.hooks[Role.PREFILL].connector
    done = Done(
        transfer_id="replayed-1", engine_id="prefill-fc", incarnation="inc1", tp_rank=0, pp_rank=0,
        num_blocks=3, reg_nonce=1, nbytes=1,
    )  # fmt: skip
    d_agent = make_agent_name("decode-fc", "inc1", 0, 0)

    async def send() -> None:  # from P's own agent (its loop thread): only the transfer is wrong
        producer._execute(Send((0, 0), d_agent, done))

    assert producer._bg is not None
    producer._bg.run(send(), 5.0)
    name, why = "kvwire_dropped_notifications", "ended_transfer"
    for _ in range(200):
        if await servers.metric(Role.DECODE, name, why) == 1:
            break
        await asyncio.sleep(0.01)
    assert await servers.metric(Role.DECODE, name, why) == 1


async def test_a_push_reg_short_of_the_prompt_is_an_error_not_200(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    def short(**fields: Any) -> PushReg:
        return PushReg(**{**fields, "num_tokens": 16})  # its first block of 115 tokens

    monkeypatch.setattr(consumer_core, "PushReg", short)  # a D that registers a prefix
    assert_kv_error(await servers.request("short-1"), "short_registration", permanent=True)
    assert await servers.metric(Role.PREFILL, "kvwire_failures", "short_registration") == 1
