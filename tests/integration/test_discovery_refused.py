"""An engine that died between health checks (or just left the fleet) refuses the router's connection:
the router re-checks it and picks another engine; the client never sees it (``-k discovery``)."""

from __future__ import annotations

import asyncio
import json

from kvwire.config import RouterConfig
from kvwire.router.app import Router
from kvwire.router.engines import EngineState
from kvwire.router.openai_api import ApiKind
from kvwire.testing.fake_engines import FakeCluster, ServerThread, fake_engine_app, fake_tokens
from kvwire.testing.procs import free_port


def test_discovery_refused_engine_is_skipped_not_failed() -> None:
    cluster = FakeCluster()
    live_p, dead_p, d = free_port(), free_port(), free_port()
    urls = {port: f"http://127.0.0.1:{port}" for port in (live_p, dead_p, d)}
    apps = [
        (fake_engine_app("prefill", cluster, 45_011), live_p),
        (fake_engine_app("decode", cluster, 45_012), d),
    ]

    async def body() -> None:
        config = RouterConfig(
            prefill_urls=(urls[dead_p], urls[live_p]), decode_urls=(urls[d],), health_interval_s=60.0
        )
        router = Router(config)
        await router.start()
        dead = router.registry.get(urls[dead_p])
        assert not dead.healthy
        # Killed after the last health check: the router's view of it is stale (healthy, last life's info).
        dead.healthy, dead.info = True, router.registry.get(urls[live_p]).info
        try:
            await requests(router, dead)
        finally:
            await router.close()

    async def requests(router: Router, dead: EngineState) -> None:
        statuses = []
        for i in range(4):  # round robin: the dead engine comes first, then every other request
            raw = json.dumps({"model": "kvwire", "prompt": f"p{i}", "max_tokens": 3}).encode()
            response = await router.serve(raw, ApiKind.COMPLETION)
            statuses.append(response.status_code)
            assert json.loads(bytes(response.body))["choices"][0]["text"] == "".join(
                map(chr, fake_tokens(f"p{i}", 3))
            )
        assert statuses == [200] * 4
        assert not dead.healthy  # re-checked when it refused, before the next pick
        assert len(cluster.prefill_bodies) == 4  # every request prefilled on the live engine

    with ServerThread(apps):
        asyncio.run(asyncio.wait_for(body(), 30))
