"""The router while the fleet changes under it (discovered engines joining and leaving mid-request), its
per-engine metrics after a departure, and client token ids of any size, against scripted engines on
127.0.0.1 (``kvwire.testing.http_fakes``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvwire.config import RouterConfig
from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.router.app import Router
from kvwire.router.engines import HealthInfo
from kvwire.router.fleet import health_info
from kvwire.router.openai_api import ApiKind
from kvwire.router.policy import Role
from kvwire.testing.http_fakes import Seen, scripted_app, serving_here
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def info(role: Role, url: str) -> HealthInfo:
    rec = EngineRecord(
        role=FleetRole(role.value), engine_id=f"{role.value}-{url[-4:]}", incarnation="a", model="kvwire",
        url=url, side_channel_host="127.0.0.1", side_channel_port=5600, mode="push",
    )  # fmt: skip
    return health_info(rec)


def found(p: str | None, d: str) -> dict[tuple[Role, str], HealthInfo]:
    """The records etcd lists: prefill ``p`` (if any) and decode ``d``."""
    out = {(Role.DECODE, d): info(Role.DECODE, d)}
    if p is not None:
        out[(Role.PREFILL, p)] = info(Role.PREFILL, p)
    return out


def _health(role: str) -> dict[str, Any]:
    return {
        "status": "ok", "role": role, "engine_id": f"{role}-0", "side_channel_host": "127.0.0.1",
        "side_channel_port": 5600, "model": "kvwire", "mode": "push",
    }  # fmt: skip


class Fleet:
    """Scripted engines; ``on_health`` runs when an engine's ``/health`` is asked (to change the fleet)."""

    def __init__(self) -> None:
        self.p1, self.p2, self.d = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
        self.prefilled: list[str] = []  # the engine id of P, per D leg
        self.on_health: Callable[[str], None] = lambda url: None
        self.credentials: dict[str, set[tuple[str | None, str | None]]] = {"health": set(), "legs": set()}

    def ports(self) -> list[int]:
        return [int(u.rpartition(":")[2]) for u in (self.p1, self.p2, self.d)]

    async def handle(self, request: Seen) -> tuple[int, Any]:
        role = "decode" if request.url == self.d else "prefill"
        sent = (request.headers.get("x-kvwire-router-token"), request.headers.get("authorization"))
        self.credentials["health" if request.path == "/health" else "legs"].add(sent)
        if request.path == "/health":
            self.on_health(request.url)
            return 200, _health(role)
        if role == "decode":  # D's leg names the P it was paired with
            self.prefilled.append(request.json()["kv_transfer_params"]["remote_engine_id"])
        choice = {"index": 0, "text": role[0], "token_ids": [1], "finish_reason": "length"}
        return 200, {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


async def _ask(router: Router, prompt: object) -> tuple[int, dict[str, Any]]:
    raw = json.dumps({"model": "kvwire", "prompt": prompt, "max_tokens": 1}).encode()
    resp = await router.serve(raw, ApiKind.COMPLETION)
    body: dict[str, Any] = json.loads(bytes(resp.body))
    return resp.status_code, body


def _router(**config: Any) -> Router:
    return Router(RouterConfig((), (), discovery="etcd://127.0.0.1:1", **config))


async def test_a_prefill_engine_leaving_during_the_pick_is_picked_again() -> None:
    """P1 is picked, then leaves (replaced by P2) while the router re-checks D's health: the request goes
    to P2, not a 500 from a forgotten URL; P1's prefix index is not re-created."""
    fleet = Fleet()
    router = _router()
    reg = router.registry
    reg.sync(found(fleet.p1, fleet.d), {})
    reg.get(fleet.d).healthy = False  # stale: the pick re-checks D, and awaits

    def p1_leaves(url: str) -> None:
        if url == fleet.d:
            reg.sync(found(fleet.p2, fleet.d), {})

    fleet.on_health = p1_leaves
    app = scripted_app(fleet.handle)
    async with serving_here([(app, port) for port in fleet.ports()]):
        status, body = await _ask(router, "z" * 64)
        assert status == 200, body
        assert fleet.prefilled == [info(Role.PREFILL, fleet.p2).engine_id]
        assert reg.prefix.size(fleet.p1) == 0 and reg.prefix.size(fleet.p2) == 4
        assert reg.get(fleet.p2).inflight == 0 and reg.get(fleet.d).inflight == 0
        with pytest.raises(KeyError):
            reg.get(fleet.p1)
    await router.client.close()


async def test_a_departed_engine_loses_its_healthy_series() -> None:
    router = _router()
    p, d = "http://127.0.0.1:9301", "http://127.0.0.1:9302"
    router.registry.sync(
        {(Role.PREFILL, p): info(Role.PREFILL, p), (Role.DECODE, d): info(Role.DECODE, d)}, {}
    )
    text = router.render_metrics().decode()
    assert f'url="{p}"' in text and f'url="{d}"' in text
    router.registry.sync(found(None, d), {})
    text = router.render_metrics().decode()
    assert f'url="{p}"' not in text  # no stale series (and no unbounded label set under churn)
    labels = f'engine_role="decode",model_name="kvwire",role="router",url="{d}"'
    assert f"kvwire_router_engine_healthy{{{labels}}} 1.0" in text


async def test_a_departed_prefill_engine_checked_while_our_request_was_on_it_leaves_no_index_entry() -> None:
    """P's record goes while a request of ours is on it (its state lingers), a health round sizes its prefix
    index again, then the request ends and the state is dropped: the size entry stayed, one per departed
    URL for good (engines that come back under new addresses grow it without bound)."""
    fleet = Fleet()
    reg = _router().registry

    async def handle(request: Seen) -> tuple[int, Any]:
        status, body = await fleet.handle(request)
        if request.path == "/health":
            body |= {"kv_blocks": 256, "block_size": 16}  # a cache size: the index sizes itself by it
        return status, body

    async with serving_here([(scripted_app(handle), port) for port in fleet.ports()]):
        for p in (fleet.p1, fleet.p2):
            reg.sync(found(p, fleet.d), {})
            reg.begin(p, fleet.d)
            reg.sync(found(None, fleet.d), {})  # its record goes; our request is still on it
            await reg.check_all()  # sizes its index again (its /health names a cache)
            reg.end(p, fleet.d)
            with pytest.raises(KeyError):
                reg.get(p)
    assert reg.prefix.urls() == set()
    await reg.close()
    await reg._client.close()


async def test_token_ids_past_32_bits_are_routed_not_a_router_error() -> None:
    """Also: the router token and engine API key go with legs only, never with a health poll (any URL
    etcd names is polled)."""
    fleet = Fleet()
    router = _router(router_token="tok", engine_api_key="key")
    reg = router.registry
    reg.sync(found(fleet.p1, fleet.d), {})
    app = scripted_app(fleet.handle)
    async with serving_here([(app, port) for port in fleet.ports()]):
        status, body = await _ask(router, [2**32, 2**64 + 5] * 16)
        assert status == 200, body
        assert reg.prefix.size(fleet.p1) == 2
        await reg.check_all()
    assert fleet.credentials == {"health": {(None, None)}, "legs": {("tok", "Bearer key")}}
    await router.client.close()
