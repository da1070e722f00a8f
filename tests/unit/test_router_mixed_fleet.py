"""A fleet of two generations (a rolling upgrade: engines whose compat hashes differ, so D's handshake
refuses the other generation's P): the router pairs each generation within itself, answers 503 (which a
client may retry) only when no P and D can pair, and stays ready while some pair can."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import pytest

from kvwire.config import Disaggregation, Policy, RouterConfig
from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.engine.server import http_error
from kvwire.errors import KVLoadFailed
from kvwire.protocol.messages import TransferMode
from kvwire.router.app import Router
from kvwire.router.engines import EngineRegistry, EngineState, HealthInfo
from kvwire.router.fleet import health_info
from kvwire.router.http import EngineClient
from kvwire.router.openai_api import ApiKind
from kvwire.router.policy import Role
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


LONG = json.dumps({"model": "kvwire", "prompt": "x" * 200, "max_tokens": 2}).encode()  # over 64 tokens


def _conditional(fleet: Fleet) -> Router:
    """A router that prefills prompts of at most 64 tokens on D itself."""
    return Router(
        RouterConfig(
            fleet.urls("prefill"), fleet.urls("decode"), disaggregation=Disaggregation.CONDITIONAL,
            local_prefill_max_tokens=64,
        )
    )  # fmt: skip


async def test_no_fitting_pair_still_lets_d_prefill_a_short_prompt_itself() -> None:
    # Conditional disaggregation: a prompt D prefills itself needs no P, so no pair has to fit.
    fleet = Fleet({"p": [NEW], "d": [OLD]})
    router = _conditional(fleet)
    async with serving_here(fleet.apps()):
        await router.registry.check_all()
        short = await router.serve(ASK, ApiKind.COMPLETION)
        long = LONG
        refused = await router.serve(long, ApiKind.COMPLETION)
        await router.close()
    assert short.status_code == 200 and refused.status_code == 503 and fleet.legs == []


# -- the registry's picks in a mixed fleet (no HTTP) ---------------------------------------------------------


def _registry(ps: str, ds: str) -> EngineRegistry:
    """Discovered engines ``p0A``, ``p1B``... of the generations the letters name."""
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)
    found = {}
    for role, gens in ((Role.PREFILL, ps), (Role.DECODE, ds)):
        for i, gen in enumerate(gens):
            url = f"http://{role.value[0]}{i}{gen}"
            rec = EngineRecord(
                role=FleetRole(role.value), engine_id=url, incarnation="i", model="kvwire", url=url,
                side_channel_host="127.0.0.1", side_channel_port=5600 + i, seed=0, mode="push", compat=gen,
            )  # fmt: skip
            found[(role, url)] = health_info(rec)
    reg.sync(found, {})
    return reg


def _picks(reg: EngineRegistry, policy: Policy, n: int, held: int = 0) -> Counter[str]:
    """``n`` requests for a prefill on P, each ended once ``held`` later ones are in flight."""
    sent: Counter[str] = Counter()
    live: list[tuple[str, str]] = []
    for _ in range(n):
        p, d = reg.fitting_pair(*reg.pick_pair(policy), policy, TransferMode.PUSH)
        assert reg.get(p.url).info.compat == reg.get(d.url).info.compat  # type: ignore[union-attr]
        sent.update((p.url, d.url))
        reg.begin(p.url, d.url)
        live.append((p.url, d.url))
        if len(live) > held:
            reg.end(*live.pop(0))
    return sent


def test_round_robin_in_a_mixed_fleet_starves_no_engine() -> None:
    # Re-picking only the picks that did not fit left the picks' lockstep rhythm in charge: with these
    # generations p1A got nothing, and of three equal new Ds one got 50 where the others got 200.
    sent = _picks(_registry("AAAB", "ABBB"), Policy.ROUND_ROBIN, 400)
    assert [sent[f"http://p{i}{g}"] for i, g in enumerate("AAAB")] == [100] * 4
    assert sent["http://d0A"] == 300 and [sent[f"http://d{i}B"] for i in (1, 2, 3)] == [34, 33, 33]
    sent = _picks(_registry("AB", "ABBB"), Policy.ROUND_ROBIN, 600)
    assert sent["http://p0A"] == sent["http://p1B"] == 300
    assert sent["http://d1B"] == sent["http://d2B"] == sent["http://d3B"] == 100


@pytest.mark.parametrize("policy", [Policy.LEAST_LOADED, Policy.PREFIX_AWARE])
def test_a_pair_is_judged_as_a_whole_not_by_an_idle_p_in_front_of_a_busy_d(policy: Policy) -> None:
    reg = _registry("AB", "AB")
    for _ in range(10):
        reg.begin("http://d0A")
    reg.begin("http://p1B")
    p, d = reg.fitting_pair(*reg.pick_pair(policy), policy, TransferMode.PUSH)
    assert (p.url, d.url) == ("http://p1B", "http://d1B")  # 1 request in flight, not 10


async def test_a_poll_of_an_engine_that_reports_no_compat_keeps_its_records() -> None:
    # A kvwire engine of the previous release: its record has the hash, its /health not. The poll replaced
    # the record's info: the hash became unknown, and the pair it cannot serve was sent legs again.
    reg = _registry("A", "B")
    state = reg.get("http://p0A")

    async def fetch(s: EngineState) -> HealthInfo:
        assert s.info is not None
        return dataclasses.replace(s.info, compat="")

    reg._fetch = fetch  # type: ignore[method-assign]
    await reg.check(state)
    assert state.info is not None and state.info.compat == "A"


async def test_conditional_disaggregation_decides_on_the_pair_that_serves() -> None:
    # The decision (prefill on D or on P) was made on the first picks, then another P was swapped in: a
    # long prompt went to a P with 50,000 prompt tokens queued because the P that cannot pair was idle.
    fleet = Fleet({"p": [OLD, NEW], "d": [NEW]})
    router = _conditional(fleet)
    async with serving_here(fleet.apps()):
        await router.registry.check_all()
        router.registry.prefill_begin(fleet.url["p1"], 50_000)  # the new P's queue
        long = LONG
        answers = [await router.serve(long, ApiKind.COMPLETION) for _ in range(4)]
        await router.close()
    assert [a.status_code for a in answers] == [200] * 4
    assert fleet.legs == []  # every one prefilled on D: the P that would serve it is the busier
