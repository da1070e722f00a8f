"""The router past its capacity: more streams than ``--max-requests`` through real HTTP to fake engines.

Before 2026-12-08 both legs of every request and the health polls shared one pool of 512 connections:
past 512 streams the health polls waited for a connection, timed out and marked healthy engines down (503
"no healthy decode engine"), and push-mode pairs starved each other (P's leg held a connection while D's
leg waited for one, until P's fence expired). Now a request over the limit is refused 503 at once, the legs'
pool holds twice the limit, and health polls have a pool of their own."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from kvwire.config import RouterConfig
from kvwire.router import cli
from kvwire.router.app import Router
from kvwire.router.openai_api import ApiKind
from kvwire.testing.fake_engines import FakeCluster, ServerThread, fake_engine_app
from kvwire.testing.procs import free_port

LIMIT = 4  # --max-requests: the legs' pool holds 8 connections
STREAMS = 14
TOKENS = 12
GAP_S = 0.05  # per token: each stream lasts about 0.6 s, over several health rounds


async def _stream(router: Router, i: int, tally: Counter[tuple[int, str]]) -> None:
    raw = json.dumps({"model": "kvwire", "prompt": f"q{i}", "max_tokens": TOKENS, "stream": True}).encode()
    resp = await router.serve(raw, ApiKind.COMPLETION)
    if resp.status_code != 200:
        tally[(resp.status_code, json.loads(bytes(resp.body))["error"]["message"])] += 1
        return
    async for _ in resp.body_iterator:
        pass
    tally[(200, "streamed")] += 1


def test_streams_past_the_limit_are_refused_at_once_and_never_mark_engines_down() -> None:
    cluster = FakeCluster(token_gap_s=GAP_S)
    pp, dp = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    apps = [(fake_engine_app("prefill", cluster, 5600), pp), (fake_engine_app("decode", cluster, 5601), dp)]
    tally: Counter[tuple[int, str]] = Counter()
    down: Counter[str] = Counter()

    async def main() -> None:
        config = RouterConfig(
            (p_url,), (d_url,), health_interval_s=0.05, health_timeout_s=0.5, max_requests=LIMIT
        )
        router = Router(config)
        await router.start()
        try:
            for wave in range(2):  # the second wave finds the router as the first left it
                tasks = [
                    asyncio.create_task(_stream(router, wave * STREAMS + i, tally)) for i in range(STREAMS)
                ]
                while not all(t.done() for t in tasks):
                    await asyncio.sleep(0.02)
                    for url in (p_url, d_url):
                        state = router.registry.get(url)
                        if state is not None and not state.healthy:
                            down[f"{state.role.value}: {state.error}"] += 1
                await asyncio.gather(*tasks)
                assert router.registry.active == 0
            assert [router.registry.get(u).inflight for u in (p_url, d_url)] == [0, 0]  # type: ignore[union-attr]
        finally:
            await router.close()

    with ServerThread(apps):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert down == Counter(), down  # the health polls never waited behind the streams
    busy = f"the router has {LIMIT} requests in flight, its limit (--max-requests)"
    refused = {k: v for k, v in tally.items() if k[0] != 200}
    assert all(status == 503 and message.startswith(busy) for status, message in refused), tally
    assert tally[(200, "streamed")] >= 2 * LIMIT  # each wave: the first LIMIT at least
    assert tally[(200, "streamed")] + sum(refused.values()) == 2 * STREAMS


class _Limits:
    """``resource``'s open-file limits, as the router sees them (nothing of this process is changed)."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard
        self.set: list[tuple[int, int]] = []

    def getrlimit(self, _which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def setrlimit(self, _which: int, limits: tuple[int, int]) -> None:
        self.set.append(limits)
        self.soft = limits[0]


def _fit(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int) -> tuple[RouterConfig, _Limits]:
    limits = _Limits(soft, hard)
    monkeypatch.setattr(cli.resource, "getrlimit", limits.getrlimit)
    monkeypatch.setattr(cli.resource, "setrlimit", limits.setrlimit)
    return cli.fit_open_files(RouterConfig(("http://p:1",), ("http://d:2",), max_requests=2048)), limits


def test_the_router_raises_its_open_file_limit_to_what_its_requests_need(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """2,048 requests hold up to 6,144 sockets (a client's and two legs each): a soft limit of 1,024 (a
    common default) would fail them with EMFILE. Raised to the hard limit; past it, fewer requests."""
    need = 2048 * 3 + 512
    config, limits = _fit(monkeypatch, 1024, 1 << 20)
    assert config.max_requests == 2048 and limits.set == [(need, 1 << 20)]
    config, limits = _fit(monkeypatch, 1024, 2048)
    assert config.max_requests == (2048 - 512) // 3 and limits.set == [(2048, 2048)]
    assert "--max-requests 2048 needs 6656 open files, the limit is 2048 (ulimit -n)" in caplog.text
    config, limits = _fit(monkeypatch, 1 << 16, 1 << 20)
    assert config.max_requests == 2048 and limits.set == []


def test_a_request_refused_at_the_limit_leaves_the_prefix_index_as_it_was() -> None:
    """A refused request's prompt was recorded in P's prefix index before the limit refused it: the
    router then believed P held prompts it never saw, under overload, when the limit fires."""
    cluster = FakeCluster()
    pp, dp = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    apps = [(fake_engine_app("prefill", cluster, 5600), pp), (fake_engine_app("decode", cluster, 5601), dp)]

    async def main() -> None:
        router = Router(RouterConfig((p_url,), (d_url,), max_requests=1))
        await router.start()
        try:
            router.registry.active = 1  # one request in flight: the limit
            raw = json.dumps({"model": "kvwire", "prompt": "z" * 200, "max_tokens": 1}).encode()
            resp = await router.serve(raw, ApiKind.COMPLETION)
            assert resp.status_code == 503
            assert router.registry.prefix.size(p_url) == 0
            assert router.registry.prefix_blocks == {"hit": 0, "total": 0}
            router.registry.active = 0
            assert (await router.serve(raw, ApiKind.COMPLETION)).status_code == 200
            assert router.registry.prefix.size(p_url) > 0 and router.registry.active == 0
        finally:
            await router.close()

    with ServerThread(apps):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert len(cluster.prefill_bodies) == 1  # only the admitted one reached P
