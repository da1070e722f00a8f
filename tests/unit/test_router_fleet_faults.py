"""The router and an engine's registration under the faults a fleet sees: a failed pull-mode stream, an
odd ``/health`` body, an SSE line longer than aiohttp reads, one URL listed under both roles, a lease that
lapsed and came back, a renewal that hangs. Scripted engines on 127.0.0.1 (``kvwire.testing.http_fakes``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from kvwire.config import EngineKind, RouterConfig
from kvwire.discovery.etcd import EtcdTarget, EtcdUnavailable
from kvwire.discovery.record import EngineRecord, FleetRole
from kvwire.discovery.registrar import Registrar
from kvwire.protocol.messages import TransferMode
from kvwire.router.app import Router
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.fleet import health_info
from kvwire.router.http import EngineClient
from kvwire.router.openai_api import ApiKind
from kvwire.router.policy import Role
from kvwire.testing.clock import until
from kvwire.testing.http_fakes import Seen, scripted_app, serving_here
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _health(role: str, url: str, mode: str = "push") -> dict[str, Any]:
    return {
        "status": "ok", "role": role, "engine_id": f"{role}-{url[-5:]}", "side_channel_host": "127.0.0.1",
        "side_channel_port": 5600, "model": "kvwire", "mode": mode,
    }  # fmt: skip


def _ask(stream: bool) -> bytes:
    return json.dumps(
        {"model": "kvwire", "prompt": "hello world", "max_tokens": 4, "stream": stream}
    ).encode()


@pytest.mark.parametrize("answer", ["error", "no_block_ids"])
async def test_a_failed_pull_stream_ends_the_in_flight_counts(answer: str) -> None:
    # Pull mode asks P first; a stream used to hand its counts to the stream's own cleanup only once D's leg
    # began, so P failing before that left P and D one request busier, for good, at each try.
    p, d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))

    async def handle(seen: Seen) -> tuple[int, Any]:
        role = "prefill" if seen.url == p else "decode"
        if seen.path == "/health":
            return 200, _health(role, seen.url, "pull")
        if role == "prefill" and answer == "error":
            return 500, {"error": {"message": "boom", "type": "internal"}}
        return 200, {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}

    router = Router(RouterConfig((p,), (d,), mode=TransferMode.PULL))
    apps = [(scripted_app(handle), int(u.rsplit(":", 1)[1])) for u in (p, d)]
    async with serving_here(apps):
        await router.registry.check_all()
        for _ in range(3):
            resp = await router.serve(_ask(stream=True), ApiKind.COMPLETION)
            assert resp.status_code == 502
        assert (router.registry.get(p).inflight, router.registry.get(d).inflight) == (0, 0)
    await router.close()


@pytest.mark.parametrize(
    "odd",
    [{"load": 0.42}, {"load": [1]}, {"load": {"running": 10**30}}, {"side_channel_port": 70000},
     {"tp_size": "2"}, {"load": {"waiting": -1}}],
)  # fmt: skip
async def test_an_odd_health_body_makes_that_engine_unhealthy_and_nothing_else(odd: dict[str, Any]) -> None:
    # A generic service's load average, a list, a count past any machine: each used to raise out of the
    # health check (AttributeError, OverflowError) and end the poller for every engine, or Router.start.
    p1, p2, d = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    odd_now = {"on": True}

    async def handle(seen: Seen) -> tuple[int, Any]:
        body = _health("decode" if seen.url == d else "prefill", seen.url)
        if seen.url == p2 and odd_now["on"]:
            body.update(odd)
        return 200, body

    router = Router(RouterConfig((p1, p2), (d,), health_interval_s=0.1))
    apps = [(scripted_app(handle), int(u.rsplit(":", 1)[1])) for u in (p1, p2, d)]
    async with serving_here(apps):
        await router.start()
        bad = router.registry.get(p2)
        assert not bad.healthy and bad.error is not None and "does not follow the API" in bad.error
        assert router.registry.get(p1).healthy and router.registry.get(d).healthy
        odd_now["on"] = False  # it mends its /health: the poller, still running, sees it
        for _ in range(50):
            if bad.healthy:
                break
            await asyncio.sleep(0.05)
        assert bad.healthy
        await router.close()


def _streaming_engine(role: str, big_at: int) -> FastAPI:
    """P answers its leg; D streams two events, the one at ``big_at`` over 512 KiB (an echoed prompt)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return _health(role, "http://x:00000")

    @app.post("/v1/completions")
    async def completions() -> Any:
        if role == "prefill":
            return JSONResponse({"choices": [{"index": 0, "text": "p", "finish_reason": "length"}]})

        def event(text: str) -> bytes:
            chunk = {"choices": [{"index": 0, "text": text, "token_ids": [1], "finish_reason": None}]}
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        async def gen() -> AsyncIterator[bytes]:
            for i in range(2):
                yield event("x" * 600_000 if i == big_at else "y")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("big_at", [0, 1])
async def test_an_sse_line_over_the_read_limit_is_a_typed_decode_error(big_at: int) -> None:
    ports = free_port(), free_port()
    servers = [
        uvicorn.Server(uvicorn.Config(_streaming_engine(role, big_at), host="127.0.0.1", port=port,
                                      log_level="warning", lifespan="off"))
        for role, port in zip(("prefill", "decode"), ports, strict=True)
    ]  # fmt: skip
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        await asyncio.sleep(0.01)
    router = Router(RouterConfig((f"http://127.0.0.1:{ports[0]}",), (f"http://127.0.0.1:{ports[1]}",)))
    try:
        await router.registry.check_all()
        resp = await router.serve(_ask(stream=True), ApiKind.COMPLETION)
        if big_at == 0:  # before any token: the leg's typed error, not a 500 "router error"
            assert resp.status_code == 502
            assert "decode engine" in json.loads(bytes(resp.body))["error"]["message"]
            return
        assert resp.status_code == 200
        body = b"".join([chunk async for chunk in resp.body_iterator])  # type: ignore[attr-defined]
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert b'"y"' in events[0]
        # An SSE error event ends it (not a cut), then [DONE] as vLLM sends it after an error.
        assert b'"error"' in events[-2] and events[-1] == b"[DONE]"
    finally:
        await router.close()
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def _info(role: Role, url: str, incarnation: str = "a") -> HealthInfo:
    rec = EngineRecord(
        role=FleetRole(role.value), engine_id=f"{role.value}-{url[-4:]}", incarnation=incarnation,
        model="kvwire", url=url, side_channel_host="127.0.0.1", side_channel_port=5600, mode="push",
    )  # fmt: skip
    return health_info(rec)


def test_a_url_listed_under_both_roles_keeps_one_state() -> None:
    # A P killed and a D started at its address within the lease: each sync used to flip the URL's state
    # and append a new one to a role's list (1,000 syncs, 1,000 states, round robin skewed to that URL).
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)
    x, d = "http://10.0.0.9:8100", "http://10.0.0.3:8200"
    both = {(Role.PREFILL, x): _info(Role.PREFILL, x), (Role.DECODE, x): _info(Role.DECODE, x),
            (Role.DECODE, d): _info(Role.DECODE, d)}  # fmt: skip
    for _ in range(100):
        reg.sync(both, {})
    assert [s.url for s in reg.engines[Role.PREFILL]] == [x]
    assert [s.url for s in reg.engines[Role.DECODE]] == [d]
    reg.sync({k: v for k, v in both.items() if k != (Role.PREFILL, x)}, {})  # the P's record expires
    assert reg.engines[Role.PREFILL] == [] and sorted(s.url for s in reg.engines[Role.DECODE]) == [d, x]
    assert reg.get(x).role is Role.DECODE


def test_an_engine_whose_lease_lapsed_is_pickable_again_when_its_record_returns() -> None:
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)
    p = "http://10.0.0.1:8100"
    found = {(Role.PREFILL, p): _info(Role.PREFILL, p)}
    reg.sync(found, {})
    reg.begin(p)  # a request on it while its record is gone
    reg.sync({}, {})
    assert not reg.in_view(p)
    reg.sync(found, {})  # the same life registered again
    state = reg.get(p)
    assert reg.in_view(p) and state.healthy and state.pickable
    reg.end(p)


class _HangingStore:
    """A lease store whose second keepalive hangs (a network drop), tracking the lease's real expiry."""

    target = EtcdTarget("127.0.0.1", 1)

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s, self.expires, self.calls, self.expired = ttl_s, 0.0, 0, 0
        self.stored: dict[str, tuple[bytes, int]] = {}

    async def grant(self, ttl: int) -> tuple[int, int]:
        self.expires = time.monotonic() + self.ttl_s
        return 1, int(self.ttl_s)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        return self.stored.get(key)

    async def keepalive(self, lease: int) -> int:
        self.calls += 1
        if self.calls == 2:
            await asyncio.sleep(30)  # until the client's timeout, or cancelled first
            raise EtcdUnavailable("timed out")
        if time.monotonic() > self.expires:
            self.expired += 1
            return 0
        self.expires = time.monotonic() + self.ttl_s
        return int(self.ttl_s)

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.stored[key] = (value, lease)

    async def revoke(self, lease: int) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_one_hung_renewal_does_not_let_the_lease_expire() -> None:
    # Before: the next try came an interval after the hung call gave up, past the TTL (2 TTL/3 + timeout).
    rec = EngineRecord(role=FleetRole.PREFILL, engine_id="p", incarnation="a", model="m", url="http://h:1",
                       side_channel_host="h", side_channel_port=1)  # fmt: skip
    store = _HangingStore(ttl_s=1.0)
    registrar = Registrar(store, lambda: rec, ttl_s=1)  # type: ignore[arg-type]
    registrar.start()
    await until(lambda: store.calls >= 4, "renewals after the hung one", timeout_s=10.0)
    await registrar.close()
    assert (store.expired, registrar.registrations) == (0, 1)


def test_pair_problems_are_judged_per_profile_not_per_pair() -> None:
    # /health judged every healthy P against every healthy D on the router's loop: 2,048 x 2,048 engines
    # took 1.3-2.5 s per probe. Now once per pair of profiles, with how many engine pairs each covers.
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)

    def rec(role: Role, url: str, seed: int) -> HealthInfo:
        return health_info(EngineRecord(
            role=FleetRole(role.value), engine_id=url, incarnation="a", model="kvwire", url=url,
            side_channel_host="127.0.0.1", side_channel_port=5600, mode="push", seed=seed, authenticated=True,
        ))  # fmt: skip

    found = {(Role.PREFILL, f"http://p{i}:1"): rec(Role.PREFILL, f"http://p{i}:1", 0) for i in range(300)}
    found |= {(Role.DECODE, f"http://d{i}:2"): rec(Role.DECODE, f"http://d{i}:2", 0) for i in range(300)}
    reg.sync(found, {})
    assert reg.pair_problems(TransferMode.PUSH) == ([], True)
    found[(Role.DECODE, "http://d7:2")] = rec(Role.DECODE, "http://d7:2", 1)  # one D on another seed
    reg.sync(found, {})
    t0 = time.perf_counter()
    problems, fitting = reg.pair_problems(TransferMode.PUSH)
    assert time.perf_counter() - t0 < 0.5 and fitting  # the 299 other Ds still pair with every P
    assert len(problems) == 1 and "seed 0" in problems[0] and "seed 1" in problems[0]
    assert problems[0].endswith("(and 299 other pairs alike)")


async def test_a_burst_finding_no_healthy_engine_shares_one_round_of_checks() -> None:
    # Every engine down: each request of a burst re-checked the whole role before refusing, so 50 requests
    # cost 50 health checks per engine at the worst moment. They now share one round.
    p, d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    seen: list[str] = []

    async def handle(seen_req: Seen) -> tuple[int, Any]:
        seen.append(seen_req.url)
        if seen_req.url == p:
            await asyncio.sleep(0.2)  # a slow, failing health check
            return 503, {}
        return 200, _health("decode", seen_req.url)

    router = Router(RouterConfig((p,), (d,)))
    apps = [(scripted_app(handle), int(u.rsplit(":", 1)[1])) for u in (p, d)]
    async with serving_here(apps):
        await router.registry.check_all()
        seen.clear()
        answers = await asyncio.gather(
            *(router.serve(_ask(stream=False), ApiKind.COMPLETION) for _ in range(50))
        )
        assert {a.status_code for a in answers} == {503}
        assert seen.count(p) <= 2  # one shared round (a second only if a request came after it ended)
    await router.close()


class _LeaseLostStore(_HangingStore):
    """The first lease is lost (a keepalive answers TTL 0); the put after the second grant hangs past the
    renewal's deadline; every later call answers."""

    def __init__(self) -> None:
        super().__init__(ttl_s=3.0)
        self.grants, self.keepalives, self.written = 0, 0, 0

    async def grant(self, ttl: int) -> tuple[int, int]:
        self.grants += 1
        return self.grants, int(self.ttl_s)

    async def keepalive(self, lease: int) -> int:
        self.keepalives += 1
        if self.keepalives == 1:  # lost: as in etcd, the keys under it go with it
            self.stored = {k: v for k, v in self.stored.items() if v[1] != lease}
            return 0
        return int(self.ttl_s)

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        if self.grants == 2 and lease == 2 and not getattr(self, "_hung", False):
            self._hung = True
            await asyncio.sleep(30)
        self.written_under = lease
        self.written += 1
        self.stored[key] = (value, lease)


async def test_a_put_cut_by_the_renewal_deadline_is_written_at_the_next_renewal() -> None:
    # The lease was lost and granted again, and the record's put under the new lease was cut by the try's
    # deadline: the next renewal found the new lease alive and skipped the record as unchanged since the
    # last put (under the lost lease), so the engine stayed out of etcd for good.
    rec = EngineRecord(role=FleetRole.PREFILL, engine_id="p", incarnation="a", model="m", url="http://h:1",
                       side_channel_host="h", side_channel_port=1)  # fmt: skip
    store = _LeaseLostStore()
    registrar = Registrar(store, lambda: rec, ttl_s=3)  # type: ignore[arg-type]
    registrar.start()
    await until(lambda: getattr(store, "written_under", 0) == 2, "the record under the new lease", 10.0)
    await registrar.close()
    assert store.grants == 2 and store.written_under == 2  # the record is under the live lease


async def test_a_pull_d_leg_names_the_hosts_ps_answer_names_not_a_stale_records() -> None:
    # The router knew P as two PP stages on two hosts (its URL fragment, or a record); P, restarted with
    # one stage, answers with no remote_hosts. D's leg must carry P's answer alone: the router's two
    # hosts beside P's pp 1 made D refuse the params and prefill locally.
    p_base, d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    p = f"{p_base}#engine_id=P&side_channel=127.0.0.1:5600&pp=2&side_channel_hosts=10.0.0.1,10.0.0.2"
    d_legs: list[dict[str, Any]] = []

    async def handle(seen: Seen) -> tuple[int, Any]:
        if seen.path == "/v1/models":
            return 200, {"data": [{"id": "kvwire"}]}
        if seen.path == "/health":
            return 200, {}
        if seen.url == p_base:
            params = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "P",
                      "remote_host": "127.0.0.1", "remote_port": 5600, "remote_tp_size": 1,
                      "remote_pp_size": 1, "remote_block_ids": [1, 2]}  # fmt: skip
            return 200, {"choices": [{"index": 0, "text": "a"}], "kv_transfer_params": params}
        d_legs.append(seen.json()["kv_transfer_params"])
        return 200, {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}

    router = Router(RouterConfig((p,), (d,), mode=TransferMode.PULL, engines=EngineKind("vllm")))
    apps = [(scripted_app(handle), int(u.rsplit(":", 1)[1])) for u in (p_base, d)]
    async with serving_here(apps):
        await router.registry.check_all()
        resp = await router.serve(_ask(stream=False), ApiKind.COMPLETION)
        assert resp.status_code == 200
    await router.close()
    assert len(d_legs) == 1 and "remote_hosts" not in d_legs[0]
    assert (d_legs[0]["remote_pp_size"], d_legs[0]["remote_block_ids"]) == (1, [1, 2])
