"""``kvwire chaos``: kill and restart P or D under load; count final states, leaked blocks, corruption.

N requests go through the router to one prefill and one decode engine (separate processes, real NIXL)
while P or D is SIGKILLed and restarted on the same ports at random moments. Every request ends in a
final state; answers are checked token for token against the colocated reference engine run in this
process. Once quiet, each engine's ``/v1/kv_stats`` says how many blocks are not free: those leaked.
Exit status 1 if a block leaked, a token was wrong, a peer did not come back or the router did not recover.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvwire.config import DEFAULT_BACKEND, Backend
from kvwire.transport.registry import names as transport_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--requests", type=int, default=1000, help="requests to send (default: %(default)s)")
    a("--kills", type=int, default=4, help="SIGKILLs, alternating P and D (default: %(default)s)")
    a("--seed", type=int, default=0, help="kill moments, victims, prompts and weights (default: %(default)s)")
    a("--concurrency", type=int, default=8, help="requests in flight (default: %(default)s)")
    a("--max-tokens", type=int, default=8, help="tokens per answer (default: %(default)s)")
    a("--min-prompt-tokens", type=int, default=8)
    a("--max-prompt-tokens", type=int, default=64)
    a("--distinct-prompts", type=int, default=64, help="prompts cycled over (default: %(default)s)")
    a("--preset", default="tiny")
    a("--backend", choices=transport_names(), default=DEFAULT_BACKEND)
    a("--request-timeout", type=float, default=30.0, help="seconds per request at the client")
    a("--kv-lease-s", type=float, default=10.0, help="P's lease on blocks D never registered")
    a("--min-down-s", type=float, default=0.2, help="shortest time a killed peer stays dead")
    a("--max-down-s", type=float, default=2.0, help="longest time a killed peer stays dead")
    a("--probe-interval", type=float, default=1.0, help="pace of requests sent while a peer is down")
    a("--quiet-timeout", type=float, default=60.0, help="bound on the wait for every block to be free")
    a("--startup-timeout", type=float, default=120.0)
    a(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the run once started (default: from the sizes)",
    )
    a("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    a("--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvwire.errors import ConfigError
    from kvwire_tools.chaos.plan import ChaosConfig
    from kvwire_tools.chaos.runner import run_chaos

    console = Console()
    try:
        cfg = ChaosConfig(
            requests=args.requests,
            kills=args.kills,
            seed=args.seed,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            min_prompt_tokens=args.min_prompt_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            distinct_prompts=args.distinct_prompts,
            preset=args.preset,
            backend=Backend(args.backend),
            request_timeout_s=args.request_timeout,
            kv_lease_s=args.kv_lease_s,
            min_down_s=args.min_down_s,
            max_down_s=args.max_down_s,
            probe_interval_s=args.probe_interval,
            quiet_timeout_s=args.quiet_timeout,
            startup_timeout_s=args.startup_timeout,
            deadline_s=args.deadline,
            json_path=args.json,
            log_dir=args.log_dir,
        )
    except ConfigError as exc:
        console.print(f"kvwire chaos: {exc}")
        return 2
    return run_chaos(cfg, console)
