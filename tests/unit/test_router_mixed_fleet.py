"""A fleet of two generations (a rolling upgrade: engines whose compat hashes differ, so D's handshake
refuses the other generation's P): the router pairs each generation within itself, answers 503 (which a
client may retry) only when no P and D can pair, and stays ready while some pair can."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvwire.config import Disaggregation, Policy, RouterConfig
from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.engine.server import http_error
from kvwire.errors import KVLoadFailed
from kvwire.router.app import Router
from kvwire.router.fleet import health_info
from kvwire.router.openai_api import ApiKind
from kvwire.testing.http_fakes import Seen, scripted_app, serving_here
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio
OLD, NEW = "a" * 64, "b" * 64
ASK = json.dumps({"model": "kvwire", "prompt": "hello world", "max_tokens": 2}).encode()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Fleet:
    """Scripted kvwire engines: each has a generation (compat hash); a D refuses another generation's P
    as a real D does after the handshake's ``IncompatiblePeer``."""

    def __init__(self, gens: dict[str, list[str]]) -> None:
        self.url: dict[str, str] = {}
        self.gen: dict[str, str] = {}  # url -> compat
        self.port: dict[str, int] = {}  # url -> side-channel port
        self.legs: list[tuple[str, str]] = []  # (P url, D url) of every D leg
        for role, compats in gens.items():
            for i, compat in enumerate(compats):
                url = f"http://127.0.0.1:{free_port()}"
                self.url[f"{role}{i}"], self.gen[url], self.port[url] = url, compat, 5600 + len(self.port)
        self.role = {url: "decode" if name.startswith("d") else "prefill" for name, url in self.url.items()}

    def urls(self, role: str) -> tuple[str, ...]:
        return tuple(u for u, r in self.role.items() if r == role)

    async def handle(self, seen: Seen) -> tuple[int, Any]:
        if seen.path == "/health":
            return 200, {
                "status": "ok", "role": self.role[seen.url], "engine_id": seen.url,
                "side_channel_host": "127.0.0.1", "side_channel_port": self.port[seen.url],
                "model": "kvwire-tiny", "seed": 0, "mode": "push", "compat": self.gen[seen.url],
            }  # fmt: skip
        params = seen.json().get("kv_transfer_params") or {}
        if self.role[seen.url] == "decode" and "remote_port" in params:
            remote = params["remote_port"]
            p_url = next(u for u, port in self.port.items() if port == remote)
            self.legs.append((p_url, seen.url))
            if self.gen[p_url] != self.gen[seen.url]:
                status, body, _ = http_error(KVLoadFailed("t", "incompatible", "compat hash differs"))
                return status, body
        return 200, {
            "id": "x", "object": "text_completion", "created": 0, "model": "kvwire",
            "choices": [{"index": 0, "text": "ab", "token_ids": [97, 98], "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }  # fmt: skip

    def apps(self) -> list[tuple[Any, int]]:
        return [(scripted_app(self.handle), int(u.rsplit(":", 1)[1])) for u in self.role]


@pytest.mark.parametrize("policy", list(Policy))
async def test_a_rolling_upgrade_pairs_each_generation_within_itself(policy: Policy) -> None:
    # Before: the router picked P and D each on its own; half the requests went to a P and a D of
    # different generations and failed (500 configuration_error, not retried) while fitting pairs idled.
    fleet = Fleet({"p": [OLD, NEW, OLD], "d": [NEW, OLD]})
    router = Router(RouterConfig(fleet.urls("prefill"), fleet.urls("decode"), policy=policy))
    async with serving_here(fleet.apps()):
        await router.registry.check_all()
        answers = [await router.serve(ASK, ApiKind.COMPLETION) for _ in range(12)]
        status, health = router.health()
        await router.close()
    assert [a.status_code for a in answers] == [200] * 12
    assert len(fleet.legs) == 12 and all(fleet.gen[p] == fleet.gen[d] for p, d in fleet.legs)
    if policy is Policy.ROUND_ROBIN:  # both generations serve (least loaded may keep to one: equal loads)
        assert {fleet.gen[d] for _, d in fleet.legs} == {OLD, NEW}
    # Ready while a pair fits; the pairs that do not are listed.
    assert status == 200 and health["status"] == "ok"
    assert health["problems"] and all("different compat hashes" in p for p in health["problems"])


async def test_no_fitting_pair_is_a_503_naming_the_compat_hashes() -> None:
    # Every P upgraded before any D: no request can be served until a D of the new generation is up. A
    # 503 (the OpenAI client retries it) naming the cause, and no leg is sent to a pair that cannot work.
    fleet = Fleet({"p": [NEW, NEW], "d": [OLD]})
    router = Router(RouterConfig(fleet.urls("prefill"), fleet.urls("decode")))
    async with serving_here(fleet.apps()):
        await router.registry.check_all()
        answer = await router.serve(ASK, ApiKind.COMPLETION)
        status, health = router.health()
        await router.close()
    error = json.loads(answer.body)["error"]
    assert answer.status_code == 503 and error["type"] == "service_unavailable"
    assert answer.headers.get("x-should-retry") != "false"
    assert "different compat hashes" in error["message"]
    assert "bbbbbbbbbbbb and aaaaaaaaaaaa" in error["message"]
    assert fleet.legs == []
    assert status == 503 and health["status"] == "misconfigured"
    assert health["problems"][0].endswith("(and 1 other pairs alike)")


def test_a_record_carries_its_compat_hash_to_the_router() -> None:
    rec = EngineRecord(
        role=FleetRole.DECODE, engine_id="d", incarnation="i", model="m", url="http://127.0.0.1:1",
        side_channel_host="127.0.0.1", side_channel_port=1, compat=NEW,
    )  # fmt: skip
    assert health_info(rec).compat == NEW


async def test_no_fitting_pair_still_lets_d_prefill_a_short_prompt_itself() -> None:
    # Conditional disaggregation: a prompt D prefills itself needs no P, so no pair has to fit.
    fleet = Fleet({"p": [NEW], "d": [OLD]})
    config = RouterConfig(
        fleet.urls("prefill"), fleet.urls("decode"), disaggregation=Disaggregation.CONDITIONAL,
        local_prefill_max_tokens=64,
    )  # fmt: skip
    router = Router(config)
    async with serving_here(fleet.apps()):
        await router.registry.check_all()
        short = await router.serve(ASK, ApiKind.COMPLETION)
        long = json.dumps({"model": "kvwire", "prompt": "x" * 200, "max_tokens": 2}).encode()
        refused = await router.serve(long, ApiKind.COMPLETION)
        await router.close()
    assert short.status_code == 200 and refused.status_code == 503 and fleet.legs == []
