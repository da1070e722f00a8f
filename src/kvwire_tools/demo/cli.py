"""``kvwire demo`` (what ``make demo`` runs): the whole system on localhost, checked against colocated."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvwire.config import DEFAULT_BACKEND, Backend
from kvwire.errors import ConfigError
from kvwire.protocol.messages import TransferMode
from kvwire.transport.registry import names as transport_names
from kvwire_tools.demo.config import DemoConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--prefill", type=int, default=1, metavar="N", help="prefill engines (default: %(default)s)")
    add("--decode", type=int, default=1, metavar="N", help="decode engines (default: %(default)s)")
    add("--p-tp", type=int, default=1, metavar="N", help="TP size of each prefill engine")
    add("--d-tp", type=int, default=1, metavar="N", help="TP size of each decode engine")
    add("--p-pp", type=int, default=1, metavar="N", help="PP size of each prefill engine")
    add("--mode", choices=[m.value for m in TransferMode], default="push", help="KV transfer mode")
    add("--backend", choices=transport_names(), default=DEFAULT_BACKEND, help="transfer backend")
    add("--preset", default="tiny", help="model preset: tiny or kv-heavy (default: %(default)s)")
    add("--requests", type=int, default=32, metavar="N", help="requests to send (default: %(default)s)")
    add(
        "--min-prompt-tokens",
        type=int,
        default=16,
        metavar="N",
        help="shortest prompt (default: %(default)s)",
    )
    add(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="longest prompt (default: %(default)s)",
    )
    add("--max-tokens", type=int, default=16, metavar="N", help="tokens generated per request")
    add("--concurrency", type=int, default=1, metavar="N", help="requests in flight at once")
    add("--seed", type=int, default=0, help="seed of the prompts and the model weights")
    add(
        "--json",
        type=Path,
        default=Path("out/demo.json"),
        metavar="PATH",
        help="summary JSON (default: %(default)s)",
    )
    add(
        "--plot",
        type=Path,
        default=Path("out/demo.png"),
        metavar="PATH",
        help="PNG plot (default: %(default)s)",
    )
    add("--no-files", action="store_true", help="write neither the JSON nor the plot")
    add(
        "--startup-timeout", type=float, default=120.0, metavar="S", help="seconds for the servers to come up"
    )
    add("--request-timeout", type=float, default=300.0, metavar="S", help="seconds per request")
    add(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="server logs (default: a temporary directory)",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        prefill=args.prefill,
        decode=args.decode,
        p_tp=args.p_tp,
        d_tp=args.d_tp,
        p_pp=args.p_pp,
        mode=TransferMode(args.mode),
        backend=Backend(args.backend),
        preset=args.preset,
        requests=args.requests,
        min_prompt_tokens=min(args.min_prompt_tokens, args.max_prompt_tokens),
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
        json_path=None if args.no_files else args.json,
        plot_path=None if args.no_files else args.plot,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        log_dir=args.log_dir,
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvwire_tools.demo.runner import run_demo

    console = Console()
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        console.print(f"kvwire demo: {exc}")
        return 2
    try:
        return run_demo(config, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; servers stopped[/yellow]")
        return 130
