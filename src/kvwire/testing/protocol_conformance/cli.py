"""``kvwire conformance``: run the wire contract's checks against a listener and print the verdicts."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvwire.errors import ConfigError
from kvwire.testing.protocol_conformance import Result, Role, Status, Target, run_checks
from kvwire.testing.protocol_conformance.notif_checks import NOTIF_CHECKS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=[r.value for r in Role], required=True, help="the target's role")
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the target's side channel")
    parser.add_argument(
        "--secret-env", metavar="VAR", default=None, help="environment variable holding the shared secret"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results")
    parser.add_argument("--rank", default="0,0", metavar="PP,TP", help="the target's rank to check")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="how long one answer may take")
    parser.add_argument(
        "--listen-host", default="127.0.0.1", help="where the kit's own side channel listens (P dials it)"
    )
    parser.add_argument(
        "--slow", action="store_true", help="also the checks that wait out the 10 s idle timer"
    )
    parser.add_argument(
        "--side-channel-only",
        action="store_true",
        help="no NIXL checks (the handshake's load, notifications)",
    )


def target_of(args: argparse.Namespace) -> Target:
    host, sep, port = str(args.target).rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--target must be HOST:PORT, got {args.target!r}")
    secret: bytes | None = None
    if args.secret_env:
        value = os.environ.get(args.secret_env, "")
        if not value:
            raise ConfigError(f"--secret-env {args.secret_env}: that variable is not set")
        secret = value.encode()
    pp, _, tp = str(args.rank).partition(",")
    if not (pp.isdigit() and tp.isdigit()):
        raise ConfigError(f"--rank must be PP,TP, got {args.rank!r}")
    return Target(host.strip("[]"), int(port), secret, int(pp), int(tp), args.timeout_s)


def table(results: list[Result], title: str) -> Table:
    out = Table(title=title)
    for col in ("check", "result", "rule", "detail"):
        out.add_column(col, overflow="fold")
    styles = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}
    for r in results:
        out.add_row(r.name, f"[{styles[r.status]}]{r.status.value}[/]", r.rule, r.detail)
    return out


def hints(results: list[Result], target: Target) -> list[str]:
    """The likely common cause of many failures, said once."""
    failed = [r.detail for r in results if r.status is Status.FAIL]
    if not any("error unauthorized" in d for d in failed):
        return []
    if target.secret is None:
        return ["the target refused requests as unauthorized: it has a secret; run with --secret-env"]
    return ["the target refused signed requests as unauthorized: is --secret-env the cluster's secret?"]


def summary(results: list[Result], target: Target, role: Role) -> dict[str, object]:
    return {
        "hints": hints(results, target),
        "target": target.address,
        "role": role.value,
        "secret": target.secret is not None,
        "passed": sum(r.status is Status.PASS for r in results),
        "failed": sum(r.status is Status.FAIL for r in results),
        "skipped": sum(r.status is Status.SKIP for r in results),
        "checks": [r.as_json() for r in results],
    }


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        target = target_of(args)
    except ConfigError as exc:
        console.print(f"[bold red]{exc}[/]")
        return 2
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        console.print(
            f"[bold red]--json {args.json}: not a file that can be written in an existing directory[/]"
        )
        return 2
    role = Role(args.role)
    skip = {c.name: "--side-channel-only" for c in NOTIF_CHECKS} if args.side_channel_only else {}

    def progress(r: Result) -> None:
        console.print(f"{r.status.value:4} {r.name} ({r.seconds:.1f} s)", highlight=False)

    results = asyncio.run(
        run_checks(target, role, slow=args.slow, listen_host=args.listen_host, skip=skip, on_result=progress)
    )
    report = summary(results, target, role)
    console.print(table(results, f"kvwire wire contract v1: {role.value} at {target.address}"))
    console.print(f"{report['passed']} passed, {report['failed']} failed, {report['skipped']} skipped")
    for hint in hints(results, target):
        console.print(f"[bold yellow]hint:[/] {hint}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failed"] else 0
