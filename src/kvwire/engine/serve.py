"""``kvwire serve prefill|decode|colocated``: one engine server (FastAPI on uvicorn).

Prefill and decode engines start a KV connector (one agent per (pp, tp) rank, a side channel); the
colocated engine is the reference with no connector. SIGINT/SIGTERM stop uvicorn, whose lifespan stops
the engine thread, which fails what is still running and closes the connector.

Start-up order: options (flag > environment > file > default), logging, the exposure check, the HTTP
socket, then the engine and its connector: a misconfiguration ends the process with one line on stderr
(``kvwire.startup``) before anything listens.
"""

from __future__ import annotations

import errno
import logging
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvwire.config import EnvConfig, env_config
from kvwire.connector import LoadFailurePolicy
from kvwire.discovery.source import check_target, redact
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.connector_hooks import ConnectorMetrics, ConnectorSettings, attach_connector
from kvwire.engine.engine import Engine
from kvwire.engine.options import check_fleet_options, connector_config
from kvwire.engine.server import EngineServer, Identity
from kvwire.errors import ConfigError, KvwireError
from kvwire.handshake.manager import stalled_reason
from kvwire.handshake.server import engine_compat_hash
from kvwire.logsetup import LogFormat, configure
from kvwire.protocol.messages import TransferMode
from kvwire.startup import bind_tcp, check_exposure, fail, in_use_message, record_stops
from kvwire.transport.base import new_incarnation

if TYPE_CHECKING:
    from kvwire.engine.fleet import Fleet

log = logging.getLogger("kvwire.serve")
_AFTER_DRAIN_S = 2  # seconds: uvicorn's wait for open connections once a drain ended (live ones get 503)


@dataclass(frozen=True)
class Started:
    """A built engine server and the socket its HTTP API will serve on."""

    server: EngineServer
    sock: socket.socket
    port: int


def _side_channel_error(exc: OSError, host: str, port: int) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        fix = "stop it or pass another --side-channel-port (0: any free port)"
        return ConfigError(in_use_message("side-channel", host, port, fix))
    return ConfigError(f"cannot start the side channel on {host}:{port}: {exc.strerror or exc}")


def build_server(values: dict[str, Any], role: Role, env: EnvConfig) -> EngineServer:
    """The engine, its connector (P and D) and its HTTP app, from resolved option values."""
    model = preset(values["preset"])
    cfg = EngineConfig(
        model,
        role=role,
        tp_size=values["tp"],
        pp_size=values.get("pp", 1),
        num_blocks=values["num_blocks"] or model.default_num_blocks,
        seed=values["seed"],
        max_num_seqs=values["max_num_seqs"],
        prefix_cache=bool(values.get("prefix_cache", False)),
        kv_load_failure_policy=LoadFailurePolicy(values.get("kv_load_failure_policy", "fail")),
    )
    engine = Engine(cfg, prefault=True)
    engine_id = values["engine_id"] or f"{role.value}-{uuid.uuid4().hex[:8]}"
    incarnation = new_incarnation()
    model_id = f"kvwire-{model.name}"
    connector, mode = None, None
    if role is not Role.COLOCATED:
        mode = TransferMode(values["mode"])
        settings = ConnectorSettings(
            engine_id=engine_id,
            incarnation=incarnation,
            # The weights' seed is part of the model's identity: P and D with different weights would
            # answer 200 with wrong tokens; with it in the compat hash the handshake refuses them.
            model_id=f"{model_id}/seed{values['seed']}",
            mode=mode,
            backend=values["backend"],
            host=values["host"],
            advertise_host=env.side_channel_host,
            port=values["side_channel_port"],
            secret=env.secret,
            accept_secret=env.accept_secret,
            config=connector_config(values, mode),
        )
        try:
            connector = attach_connector(engine, settings).connector
        except OSError as exc:
            raise _side_channel_error(exc, values["host"], values["side_channel_port"]) from None
    identity = Identity(
        role=role,
        engine_id=engine_id,
        incarnation=incarnation,
        side_channel_host=env.side_channel_host or values["host"],
        side_channel_port=connector.port if connector is not None else 0,
        model=model_id,
        seed=values["seed"],
        mode=mode,
        authenticated=env.secret is not None,
        compat=engine_compat_hash(connector.engine) if connector is not None else "",
        aliases=tuple(n.strip() for n in values["served_model_name"].split(",") if n.strip()),
    )
    server = EngineServer(engine, identity, api_key=values["api_key"], router_token=values["router_token"])
    if connector is not None:
        server.scrape_hooks.append(ConnectorMetrics(connector, server.metrics).sync)
        conn = connector  # /health: 503 while an agent is held by a NIXL call stuck on the network
        server.health_checks.append(lambda: stalled_reason(conn.managers.values()))
    return server


def start(values: dict[str, Any], role: Role, env: EnvConfig) -> Started:
    check_exposure(values["host"], env.secret, values["insecure"], accept=env.accept_secret)
    if values.get("discovery"):
        # A bad --discovery (or its missing password) ends start-up before anything listens.
        check_target(values["discovery"], client=True)
    check_fleet_options(values)
    if role is not Role.COLOCATED:
        connector_config(values, TransferMode(values["mode"]))  # refuse bad knobs before building anything
    port = values["port"]
    sock = bind_tcp(values["host"], port, "HTTP", "stop it or pass another --port")
    try:
        server = build_server(values, role, env)
    except BaseException:
        sock.close()
        raise
    return Started(server, sock, sock.getsockname()[1])


def summary(values: dict[str, Any], started: Started, env: EnvConfig) -> str:
    """The start-up line: who this engine is, where it listens, and how it is protected."""
    ident, cfg = started.server.identity, started.server.engine.cfg
    parts = [
        f"{ident.role.value} engine {ident.engine_id} serving http://{values['host']}:{started.port}",
        f"model {ident.model} seed {ident.seed}",
        f"tp={cfg.tp_size} pp={cfg.pp_size}",
    ]
    if ident.mode is not None:
        parts += [
            f"side channel {values['host']}:{ident.side_channel_port} "
            f"advertised as {ident.side_channel_host}:{ident.side_channel_port}",
            f"mode {ident.mode.value}",
            f"backend {values['backend']}",
        ]
    parts += [
        f"secret {'set' if env.secret else 'not set'}",
        f"api key {'set' if values['api_key'] else 'not set'}",
    ]
    if values["insecure"]:
        parts.append("insecure")
    return "; ".join(parts)


def _fleet(values: dict[str, Any], started: Started, env: EnvConfig) -> Fleet | None:
    """The engine's etcd registration (``--discovery``), installed on its app; None without it."""
    if not values.get("discovery"):
        return None
    from kvwire.engine.fleet import Fleet  # uvicorn and aiohttp: imported only when serving

    url = values["advertise_url"] or f"http://{env.side_channel_host or values['host']}:{started.port}"
    fleet = Fleet(started.server, values["discovery"], url.rstrip("/"), values["discovery_ttl"],
                  values["drain_timeout"])  # fmt: skip
    fleet.install(started.server.app)
    log.info("registering in %s as %s (lease ttl %d s asked)", redact(values["discovery"]), url,
             values["discovery_ttl"])  # fmt: skip
    return fleet


def run_engine(values: dict[str, Any], role: Role) -> int:
    """Serve one engine with its resolved options (``kvwire.serve`` resolves them) until a signal."""
    import uvicorn

    prog = f"kvwire serve {role.value}"
    try:
        env = env_config()
        configure(values["log_level"], LogFormat(values["log_format"]), values["log_http"])
        started = start(values, role, env)
    except KvwireError as exc:
        return fail(prog, exc)
    server = started.server
    log.info("%s", summary(values, started, env))
    if env.secret is None:
        log.warning("KVWIRE_SECRET is not set: the side channel authenticates no peer")
    fleet = _fleet(values, started, env)
    config = uvicorn.Config(
        server.app, host=values["host"], port=started.port, log_config=None, lifespan="on", access_log=False,
        # Under --discovery the drain already waited (at most --drain-timeout): then uvicorn's own wait for
        # open connections must not hold the process past it (it has no bound of its own).
        timeout_graceful_shutdown=None if fleet is None else _AFTER_DRAIN_S,
    )  # fmt: skip
    if fleet is None:
        userver = uvicorn.Server(config)
    else:
        from kvwire.engine.fleet import DrainingServer

        userver = DrainingServer(config, fleet)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler that was
    # installed before it: this one records it, so a requested stop exits with status 0.
    stopped_by = record_stops(userver)
    try:
        userver.run(sockets=[started.sock])
    finally:
        server.stop()
        if server.engine.hooks is not None:
            server.engine.hooks.close()
    if stopped_by:
        log.info("%s engine stopped by signal %d", role.value, stopped_by[0])
    return 0
