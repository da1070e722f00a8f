"""What an operator and a client see over HTTP: API keys, permanent misconfigurations the openai client does
not retry, per-role metrics, JSON logs with transfer ids."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwire.config import RouterConfig
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.server import EngineServer, Identity, http_error
from kvwire.errors import KVLoadFailed
from kvwire.logsetup import Throttle, configure, transfer_extra
from kvwire.metrics import KvMetrics, MetricRole, posts_transfers
from kvwire.options import LogFormat
from kvwire.protocol.messages import FailReason, TransferMode
from kvwire.router.app import create_app
from kvwire.router.engines import HealthInfo, pair_problem
from kvwire.router.openai_api import ErrorType, engine_error_kind
from kvwire.router.policy import Load
from kvwire.testing.fake_engines import ServerThread
from kvwire.testing.http_fakes import Seen, scripted_app
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- engines -----------------------------------------------------------------------------------------------


async def test_engine_api_key_guards_v1_and_leaves_health_open() -> None:
    engine = Engine(EngineConfig(preset("tiny"), num_blocks=16))
    server = EngineServer(engine, Identity(Role.COLOCATED, "c", "i"), api_key="s3cret")
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            refused = await c.get("/v1/models", headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200


def test_permanent_kv_failures_are_not_503s() -> None:
    status, body, headers = http_error(KVLoadFailed("t1", "incompatible"))
    assert (status, headers) == (500, {"x-should-retry": "false"})
    assert body["error"]["type"] == "configuration_error" and "--seed" in body["error"]["message"]
    status, body, headers = http_error(KVLoadFailed("t1", "peer_dead"))  # transient: a retry may succeed
    assert (status, headers) == (503, {})
    assert "KVWIRE_SECRET" in body["error"]["message"]  # one of the causes a client cannot see otherwise
    status, body, headers = http_error(KVLoadFailed("t1", "digest_unavailable"))  # P's KV not in host memory
    assert (status, headers) == (500, {"x-should-retry": "false"})
    assert "--kv-digest-sample 0" in body["error"]["message"]
    assert engine_error_kind(500, "configuration_error") is ErrorType.MISCONFIGURED
    assert engine_error_kind(401) is ErrorType.MISCONFIGURED  # an engine refused the router's key
    assert engine_error_kind(403, "permission_error") is ErrorType.MISCONFIGURED  # ...or its router token
    assert engine_error_kind(404, "not_found_error") is ErrorType.MISCONFIGURED  # ...or its model name
    assert engine_error_kind(503) is ErrorType.UNAVAILABLE


# -- router ------------------------------------------------------------------------------------------------


def _health(role: str, *, authenticated: bool, mode: str = "push", seed: int = 0) -> dict[str, Any]:
    return {
        "status": "ok", "role": role, "engine_id": f"{role}-0", "incarnation": "1",
        "side_channel_host": "127.0.0.1", "side_channel_port": 5600, "tp_size": 1, "pp_size": 1,
        "model": "kvwire-tiny", "seed": seed, "mode": mode, "authenticated": authenticated,
        "load": {"running": 0, "waiting": 0, "free_blocks": 100},
    }  # fmt: skip


class Engines:
    """The engines behind a router, scripted: their /health, and every request they got."""

    def __init__(self, p_secret: bool, d_secret: bool) -> None:
        self.p_port, self.d_port = free_port(), free_port()
        self.health = {
            self.p_port: _health("prefill", authenticated=p_secret),
            self.d_port: _health("decode", authenticated=d_secret),
        }
        self.seen: list[Seen] = []

    async def __call__(self, request: Seen) -> tuple[int, Any]:
        self.seen.append(request)
        if request.path == "/health":
            return 200, self.health[int(request.url.rpartition(":")[2])]
        return 500, {"error": {"message": "no leg expected", "type": "internal_error"}}


@pytest.fixture
def one_sided() -> Iterator[tuple[str, Engines]]:
    """A router (keys: clients 'rk', engines 'ek') whose P has KVWIRE_SECRET and whose D has not."""
    engines = Engines(p_secret=True, d_secret=False)
    config = RouterConfig(
        prefill_urls=(f"http://127.0.0.1:{engines.p_port}",),
        decode_urls=(f"http://127.0.0.1:{engines.d_port}",),
        api_key="rk",
        engine_api_key="ek",
        health_interval_s=60.0,
    )
    port = free_port()
    fake = scripted_app(engines)
    apps = [(fake, engines.p_port), (fake, engines.d_port), (create_app(config), port)]
    with ServerThread(apps):
        yield f"http://127.0.0.1:{port}", engines


def test_secret_on_one_side_is_a_500_the_openai_client_does_not_retry(one_sided: tuple[str, Engines]) -> None:
    url, engines = one_sided
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    with (
        openai.OpenAI(base_url=url + "/v1", api_key="rk", max_retries=3, http_client=http) as client,
        pytest.raises(openai.InternalServerError) as exc,
    ):
        client.completions.create(model="kvwire", prompt="hello", max_tokens=2)
    assert len(sent) == 1  # not retried
    assert exc.value.response.headers["x-should-retry"] == "false"
    message = str(exc.value)
    assert (
        "KVWIRE_SECRET is set on the prefill engine prefill-0 but not on the decode engine decode-0"
        in message
    )
    assert "127.0.0.1" not in message  # no internal address in the client's error
    # No leg was sent to a pair that cannot work.
    assert engines.seen and all(r.path == "/health" for r in engines.seen)
    # /health is open: the engine key goes with legs only (test_router_fleet_races checks it is sent there).
    assert all("authorization" not in r.headers for r in engines.seen)
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "misconfigured"
    assert "KVWIRE_SECRET" in health.json()["problems"][0]


def test_router_api_key(one_sided: tuple[str, Engines]) -> None:
    url, _ = one_sided
    with (
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key="rk") as right:
        assert [m.id for m in right.models.list()]
    assert httpx.get(url + "/metrics").status_code == 200  # scrapers need no key


def test_pair_problems_name_what_differs() -> None:
    def info(role: str, **kw: Any) -> HealthInfo:
        base: dict[str, Any] = {"seed": 0, "mode": TransferMode.PUSH, "authenticated": True, **kw}
        return HealthInfo(role, f"{role}-0", "1", "h", 1, 1, 1, "kvwire-tiny", Load(), **base)

    p = info("prefill")
    assert pair_problem(p, info("decode"), TransferMode.PUSH) is None
    assert "--mode" in (pair_problem(p, info("decode", mode=TransferMode.PULL), TransferMode.PUSH) or "")
    assert "seed 0" in (pair_problem(p, info("decode", seed=1), TransferMode.PUSH) or "")
    assert "same KVWIRE_SECRET" in (
        pair_problem(p, info("decode", authenticated=False), TransferMode.PUSH) or ""
    )
    # vLLM engines say none of it: nothing to compare.
    assert (
        pair_problem(p, info("decode", seed=None, mode=None, authenticated=None), TransferMode.PUSH) is None
    )


# -- metrics and logs --------------------------------------------------------------------------------------


def _families(m: KvMetrics) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(m.render().decode()):
        names.add(family.name)
        for s in family.samples:
            assert (s.labels["role"], s.labels["model_name"]) == (m.role.value, "m")
    return names


def test_each_role_exports_only_the_families_it_fills() -> None:
    def metrics(role: MetricRole, mode: TransferMode | None) -> set[str]:
        return _families(KvMetrics(role, "m", transfers=posts_transfers(role, mode)))

    p_push, d_push = (
        metrics(MetricRole.PREFILL, TransferMode.PUSH),
        metrics(MetricRole.DECODE, TransferMode.PUSH),
    )
    d_pull, router = metrics(MetricRole.DECODE, TransferMode.PULL), metrics(MetricRole.ROUTER, None)
    colocated = metrics(MetricRole.COLOCATED, None)
    assert "kvwire_transfer_seconds" in p_push and "kvwire_transfer_seconds" in d_pull
    assert "kvwire_transfer_seconds" not in d_push  # P posts, P counts
    assert "kvwire_kv_wait_seconds" in d_push and "kvwire_kv_wait_seconds" not in p_push
    assert "kvwire_handshakes" in d_push and "kvwire_handshakes" not in colocated
    assert {"kvwire_inter_token_latency_seconds", "kvwire_e2e_request_latency_seconds"} <= router
    assert not any(n.startswith(("kvwire_transfer", "kvwire_handshake", "kvwire_blocks")) for n in router)
    assert "kvwire_inter_token_latency_seconds" not in p_push


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_json_logs_carry_the_transfer_id_and_http_libraries_stay_quiet(
    root_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    configure("debug", LogFormat.JSON)
    logging.getLogger("kvwire.test").debug("request done", extra=transfer_extra("t-42"))
    logging.getLogger("httpcore").debug("send_request_headers.started")  # one per request otherwise
    logging.getLogger("aiohttp.client").debug("the router's client to its engines")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {
            "ts": lines[0]["ts"],
            "level": "debug",
            "logger": "kvwire.test",
            "msg": "request done",
            "transfer_id": "t-42",
        }
    ]
    configure("debug", LogFormat.TEXT, http=True)
    logging.getLogger("httpcore").debug("asked for")
    assert "asked for" in out.getvalue()


async def test_secret_on_prefill_only_is_a_permanent_error_naming_the_secret() -> None:
    """Real connectors (in-process transport): P has KVWIRE_SECRET, D has none; P refuses D's handshake
    and D's client is told what may be wrong, not only 'handshake_failed'."""
    from kvwire.connector import ConnectorConfig
    from kvwire.engine.connector_hooks import ConnectorSettings, attach_connector

    tiny = preset("tiny")
    p_eng = Engine(EngineConfig(tiny, role=Role.PREFILL, num_blocks=32))
    p_hooks = attach_connector(p_eng, ConnectorSettings("p-sec", "i1", "m", backend="inproc", secret=b"s3"))
    d_eng = Engine(EngineConfig(tiny, role=Role.DECODE, num_blocks=32))
    cfg = ConnectorConfig(handshake_retries=0)
    d_hooks = attach_connector(d_eng, ConnectorSettings("d-open", "i1", "m", backend="inproc", config=cfg))
    d = EngineServer(d_eng, Identity(Role.DECODE, "d-open", "i1", mode=TransferMode.PUSH))
    d.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=d.app), base_url="http://d") as dc:
            params = {
                "do_remote_prefill": True, "transfer_id": "t-sec", "remote_engine_id": "p-sec",
                "remote_host": "127.0.0.1", "remote_port": p_hooks.connector.port,
            }  # fmt: skip
            r = await dc.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": params})
        # A permanent misconfiguration: 500 with x-should-retry: false, naming the cause and the fix.
        assert r.status_code == 500, r.text
        assert r.headers.get("x-should-retry") == "false"
        assert "unauthorized" in r.json()["error"]["message"]
        assert "KVWIRE_SECRET" in r.json()["error"]["message"]
    finally:
        d.stop()
        for hooks in (d_hooks, p_hooks):
            hooks.close()


async def test_a_peer_outside_allowed_peers_is_handshake_failed_naming_allowed_peers() -> None:
    """D's allowed_peers leaves P's address out: D never dials it. That is handshake_failed (a 503 naming
    allowed_peers), not unauthorized (a 500 telling the operator to fix KVWIRE_SECRET, which is fine)."""
    from kvwire.connector import ConnectorConfig
    from kvwire.engine.connector_hooks import ConnectorSettings, attach_connector

    tiny = preset("tiny")
    p_eng = Engine(EngineConfig(tiny, role=Role.PREFILL, num_blocks=32))
    p_hooks = attach_connector(p_eng, ConnectorSettings("p-far", "i1", "m", backend="inproc"))
    d_eng = Engine(EngineConfig(tiny, role=Role.DECODE, num_blocks=32))
    cfg = ConnectorConfig(handshake_retries=0, allowed_peers="10.0.0.0/8")
    d_hooks = attach_connector(d_eng, ConnectorSettings("d-near", "i1", "m", backend="inproc", config=cfg))
    d = EngineServer(d_eng, Identity(Role.DECODE, "d-near", "i1", mode=TransferMode.PUSH))
    d.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=d.app), base_url="http://d") as dc:
            params = {
                "do_remote_prefill": True, "transfer_id": "t-far", "remote_engine_id": "p-far",
                "remote_host": "127.0.0.1", "remote_port": p_hooks.connector.port,
            }  # fmt: skip
            r = await dc.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": params})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "handshake_failed" in message and "allowed_peers" in message
        assert d_hooks.connector.stats.failures[FailReason.HANDSHAKE_FAILED] == 1
    finally:
        d.stop()
        for hooks in (d_hooks, p_hooks):
            hooks.close()


def test_throttle_logs_one_line_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttle = Throttle(interval_s=10.0, clock=lambda: now[0])
    logger = logging.getLogger("kvwire.test.throttle")
    with caplog.at_level(logging.WARNING, logger="kvwire.test.throttle"):
        sent = []
        for step in range(30):  # one a second for 30 s
            now[0] = 100.0 + step
            sent.append(throttle.log(logger, logging.WARNING, "dropped %s", step))
    assert [i for i, s in enumerate(sent) if s] == [0, 10, 20]
    assert [r.getMessage() for r in caplog.records] == [
        "dropped 0",
        "dropped 10 (and 9 more like it not logged)",
        "dropped 20 (and 9 more like it not logged)",
    ]
    assert throttle.suppressed == 9


async def test_the_router_refuses_a_body_past_16_mib_and_answers_unknown_paths_as_openai_errors() -> None:
    """The router read bodies of any size (a 200 MiB post: +1 GiB resident), and FastAPI's own refusals
    came as ``{"detail": ...}``, which an OpenAI client cannot read."""
    from kvwire.apikey import MAX_BODY_BYTES

    config = RouterConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",))
    transport = httpx.ASGITransport(app=create_app(config))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        big = await client.post("/v1/completions", content=b"{" + b" " * MAX_BODY_BYTES + b"}")
        assert big.status_code == 400 and "byte limit" in big.json()["error"]["message"]
        counted = {
            s.labels["outcome"]: s.value
            for f in text_string_to_metric_families((await client.get("/metrics")).text)
            if f.name == "kvwire_requests"
            for s in f.samples
            if s.name.endswith("_total")
        }
        assert counted == {"bad_request": 1.0}, counted  # counted like any other refused request
        missing = await client.get("/v1/nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        wrong = await client.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_command_line_values_out_of_range_are_refused_naming_them() -> None:
    """``--port 70000`` bound port 4464 (the kernel takes it modulo 65536), ``--port -1`` was blamed on
    ``--host``, and a NaN timeout started a router whose every request was then a 500."""
    from kvwire.errors import ConfigError
    from kvwire.startup import bind_tcp

    for port in (70000, -1):
        with pytest.raises(ConfigError, match=f"port {port} is out of range"):
            bind_tcp("127.0.0.1", port, "HTTP", "pass another --port")
    with pytest.raises(ConfigError, match="request_timeout_s must be a positive number"):
        RouterConfig(
            prefill_urls=("http://h:1",), decode_urls=("http://h:2",), request_timeout_s=float("nan")
        )


async def test_the_router_cancels_a_unary_answer_whose_client_hung_up() -> None:
    """uvicorn does not cancel a plain handler when its client leaves: the router waited for D's whole
    answer (10 s of generation for a client gone at 1.5 s). Its legs are cancelled now, and with them
    the engines' requests."""
    import asyncio

    from fastapi.responses import JSONResponse

    from kvwire.apikey import unless_client_gone

    class Client:
        gone = False

        async def is_disconnected(self) -> bool:
            return self.gone

    cancelled = asyncio.Event()

    async def long_answer() -> JSONResponse:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return JSONResponse({})

    client = Client()
    served = asyncio.create_task(unless_client_gone(client, long_answer()))  # type: ignore[arg-type]
    await asyncio.sleep(0.3)
    assert not served.done()
    client.gone = True
    response = await asyncio.wait_for(served, 2)
    assert response.status_code == 499 and cancelled.is_set()
    quick = await unless_client_gone(Client(), asyncio.sleep(0, JSONResponse({"ok": 1})))  # type: ignore[arg-type]
    assert quick.status_code == 200
