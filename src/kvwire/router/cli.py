"""``kvwire serve router``: the OpenAI-compatible router in front of prefill and decode engines."""

from __future__ import annotations

import argparse
import logging
import sys

from kvwire.config import EngineKind, Policy, RouterConfig, env_config, split_urls
from kvwire.errors import ConfigError
from kvwire.protocol.messages import TransferMode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill engine URL (repeat, or comma-separate, for several)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode engine URL (repeat, or comma-separate, for several)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.ROUND_ROBIN.value,
        help="how to pick P and D (default: %(default)s)",
    )
    parser.add_argument(
        "--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value,
        help="KV transfer mode of the engines: push sends both legs at once, pull sends P's first",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="kvwire", help="model name served (engines' names are also served)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds per request (both legs)"
    )
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument(
        "--engines", choices=[k.value for k in EngineKind], default=EngineKind.KVWIRE.value,
        help="kvwire engines, or vLLM servers running KvwireConnector (then each --prefill URL ends with "
        "#engine_id=ID&side_channel=HOST:PORT[&tp=N&pp=N], its kv_connector_extra_config's values)",
    )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill_urls=split_urls(args.prefill),
        decode_urls=split_urls(args.decode),
        policy=Policy(args.policy),
        mode=TransferMode(args.mode),
        host=args.host,
        port=args.port,
        model=args.model,
        request_timeout_s=args.request_timeout,
        health_interval_s=args.health_interval,
        engines=EngineKind(args.engines),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        env = env_config()
    except ConfigError as exc:
        print(f"kvwire serve router: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from kvwire.router.app import create_app

    logging.basicConfig(level=env.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if env.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    app = create_app(config)
    access_log = env.log_level == "debug"
    uvicorn.run(app, host=config.host, port=config.port, log_level=env.log_level, access_log=access_log)
    return 0
