"""P and D with different weights never exchange KV, and the client is told which fields differ.

Reference engines with kvwire's connector (in-process transport) on real ports behind the router; P's
weights come from seed 1, D's from seed 2, so their model ids differ. The client (the official ``openai``
client) gets an error naming ``model_id`` with both values, never 200 with wrong tokens.
"""

from __future__ import annotations

import openai
import pytest

from kvwire.config import RouterConfig
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.connector_hooks import ConnectorSettings, attach_connector
from kvwire.engine.engine import Engine
from kvwire.engine.server import EngineServer, Identity
from kvwire.router.app import create_app
from kvwire.testing.fake_engines import ServerThread
from kvwire.testing.procs import free_port

TINY = preset("tiny")


def _server(role: Role, seed: int) -> EngineServer:
    engine = Engine(EngineConfig(TINY, role=role, num_blocks=64, seed=seed))
    eid = f"{role.value}-seed{seed}"
    settings = ConnectorSettings(eid, "inc1", f"kvwire-tiny/seed{seed}", backend="inproc")
    hooks = attach_connector(engine, settings)
    return EngineServer(engine, Identity(role, eid, "inc1", "127.0.0.1", hooks.connector.port))


def test_different_weights_are_refused_and_the_client_is_told_what_differs() -> None:
    p, d = _server(Role.PREFILL, 1), _server(Role.DECODE, 2)
    pp, dp, rp = (free_port() for _ in range(3))
    config = RouterConfig(prefill_urls=(f"http://127.0.0.1:{pp}",), decode_urls=(f"http://127.0.0.1:{dp}",))
    with ServerThread([(p.app, pp), (d.app, dp), (create_app(config), rp)]):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rp}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="kvwire-tiny", prompt="hello", max_tokens=3)
        client.close()
    message = refused.value.message
    assert "model_id 'kvwire-tiny/seed2' here vs 'kvwire-tiny/seed1' at the peer" in message
    assert refused.value.status_code != 503  # permanent: the openai client must not retry it
    assert "127.0.0.1" not in message
