"""``kvwire serve prefill|decode|colocated``: one engine server (FastAPI on uvicorn).

Prefill and decode engines start a KV connector (one agent per (pp, tp) rank, a side channel); the
colocated engine is the reference with no connector. SIGINT/SIGTERM stop uvicorn, whose lifespan stops
the engine thread, which fails what is still running and closes the connector.
"""

from __future__ import annotations

import argparse
import logging
import signal
import uuid

from kvwire.config import Backend, env_config
from kvwire.connector import ConnectorConfig, LoadFailurePolicy
from kvwire.engine.config import PRESETS, EngineConfig, Role, preset
from kvwire.engine.connector_hooks import ConnectorMetrics, ConnectorSettings, attach_connector
from kvwire.engine.engine import Engine
from kvwire.engine.server import EngineServer, Identity
from kvwire.errors import KvwireError
from kvwire.protocol.messages import TransferMode
from kvwire.transport.base import new_incarnation

log = logging.getLogger("kvwire.serve")

_DEFAULT_PORTS = {Role.PREFILL: 8100, Role.DECODE: 8200, Role.COLOCATED: 8300}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP and side-channel bind address")
    parser.add_argument(
        "--port", type=int, default=None, help="HTTP port (prefill 8100, decode 8200, colocated 8300)"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads sharded)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (prefill only)")
    parser.add_argument("--side-channel-port", type=int, default=0, help="0: any free port (see /health)")
    parser.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.NIXL.value)
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value)
    parser.add_argument("--seed", type=int, default=0, help="weights seed (P, D and reference must agree)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: the preset's)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--engine-id", default=None, help="default: ROLE-<random>")
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=[p.value for p in LoadFailurePolicy],
        default=LoadFailurePolicy.FAIL.value,
        help="decode: answer 503 (fail) or prefill locally (recompute) when the KV does not arrive",
    )
    parser.add_argument("--kv-lease-s", type=float, default=30.0, help="prefill: how long blocks wait for D")


def build_server(args: argparse.Namespace, role: Role) -> EngineServer:
    env = env_config()
    model = preset(args.preset)
    cfg = EngineConfig(
        model,
        role=role,
        tp_size=args.tp,
        pp_size=args.pp,
        num_blocks=args.num_blocks or model.default_num_blocks,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        kv_load_failure_policy=LoadFailurePolicy(args.kv_load_failure_policy),
    )
    engine = Engine(cfg, prefault=True)
    engine_id = args.engine_id or f"{role.value}-{uuid.uuid4().hex[:8]}"
    incarnation = new_incarnation()
    model_id = f"kvwire-{model.name}"
    connector = None
    if role is not Role.COLOCATED:
        settings = ConnectorSettings(
            engine_id=engine_id,
            incarnation=incarnation,
            # The weights' seed is part of the model's identity: P and D with different weights would
            # answer 200 with wrong tokens; with it in the compat hash the handshake refuses them.
            model_id=f"{model_id}/seed{args.seed}",
            mode=TransferMode(args.mode),
            backend=args.backend,
            host=args.host,
            advertise_host=env.side_channel_host,
            port=args.side_channel_port,
            secret=env.secret,
            config=ConnectorConfig(
                kv_lease_duration_s=args.kv_lease_s,
                kv_load_failure_policy=cfg.kv_load_failure_policy,
            ),
        )
        connector = attach_connector(engine, settings).connector
    identity = Identity(
        role=role,
        engine_id=engine_id,
        incarnation=incarnation,
        side_channel_host=env.side_channel_host or args.host,
        side_channel_port=connector.port if connector is not None else 0,
        model=model_id,
    )
    server = EngineServer(engine, identity)
    if connector is not None:
        server.scrape_hooks.append(ConnectorMetrics(connector, server.metrics).sync)
    return server


def run(args: argparse.Namespace) -> int:
    import uvicorn

    env = env_config()
    logging.basicConfig(level=env.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = Role(str(args._path).split()[-1])
    port = args.port if args.port is not None else _DEFAULT_PORTS[role]
    try:
        server = build_server(args, role)
    except KvwireError as exc:
        log.error("cannot start the %s engine: %s", role.value, exc)
        return 2
    ident = server.identity
    log.info(
        "%s engine %s on http://%s:%d (side channel %s:%d, tp=%d pp=%d, %s)",
        role.value,
        ident.engine_id,
        args.host,
        port,
        ident.side_channel_host,
        ident.side_channel_port,
        args.tp,
        args.pp,
        ident.model,
    )
    config = uvicorn.Config(server.app, host=args.host, port=port, log_level="warning", lifespan="on")
    stopped_by: list[int] = []
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler that was
    # installed before it: this one records it, so a requested stop exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopped_by.append(signum))
    try:
        uvicorn.Server(config).run()
    finally:
        server.stop()
        if server.engine.hooks is not None:
            server.engine.hooks.close()
    if stopped_by:
        log.info("%s engine stopped by signal %d", role.value, stopped_by[0])
    return 0
