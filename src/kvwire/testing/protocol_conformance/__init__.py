"""The wire contract's conformance kit: ``kvwire conformance --role prefill|decode --target HOST:PORT``.

It checks any implementation of docs/protocol.md, kvwire's or another engine's, from the outside: over
the target's side channel (good answers, every refusal the contract lists, authentication and sealing
under a secret, the connection rules) and, against a prefill engine in push mode, over notifications
through a NIXL agent the kit creates (progress thread off) for a decode engine of its own. Each check
names the section of docs/protocol.md it tests; the run prints a pass/fail table (``--json`` writes it
too) and fails when any check fails. It imports no test framework: ``run_checks`` is the library entry.

(``kvwire.testing.conformance`` is another suite: the transport backends' contract, under pytest.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvwire.testing.protocol_conformance.model import Check, Context, Result, Role, Skipped, Status
from kvwire.testing.protocol_conformance.notif_checks import NOTIF_CHECKS
from kvwire.testing.protocol_conformance.side_checks import SIDE_CHECKS
from kvwire.testing.protocol_conformance.wire import CheckFailed, Target

ALL_CHECKS: tuple[Check, ...] = SIDE_CHECKS + NOTIF_CHECKS


def left_out(check: Check, *, secret: bool, slow: bool) -> str | None:
    """Why a check of the target's role does not run here (listed as skipped, never silently absent: a
    peer without a secret must not read as one that passed §4)."""
    if check.slow and not slow:
        return "takes the protocol's own timers: run with --slow"
    if check.secret is True and not secret:
        return "needs a secret: run with --secret-env against a cluster that has one"
    if check.secret is False and secret:
        return "for a cluster without a secret: run without --secret-env"
    return None


async def run_one(check: Check, ctx: Context) -> Result:
    start = time.monotonic()
    try:
        detail = await check.run(ctx)
        status = Status.PASS
    except CheckFailed as exc:
        detail, status = str(exc), Status.FAIL
    except Skipped as exc:
        detail, status = str(exc), Status.SKIP
    except Exception as exc:  # the peer broke the kit's expectations in a way no check foresaw
        detail, status = f"{type(exc).__name__}: {exc}", Status.FAIL
    return Result(check.name, check.rule, status, detail, time.monotonic() - start)


async def run_checks(
    target: Target,
    role: Role,
    *,
    slow: bool = False,
    listen_host: str = "127.0.0.1",
    checks: Sequence[Check] = ALL_CHECKS,
    skip: Mapping[str, str] | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run every check of ``role`` in order; those that do not apply here (a secret, ``--slow``) or that
    ``skip`` names (check name -> why) are results too, skipped with the reason. ``on_result`` hears each
    result as it comes (a peer that times out everywhere takes minutes)."""
    ctx = Context(target, role, listen_host)
    results: list[Result] = []
    try:
        for check in checks:
            if role not in check.roles:
                continue
            why = (skip or {}).get(check.name) or left_out(check, secret=target.secret is not None, slow=slow)
            result = (
                Result(check.name, check.rule, Status.SKIP, why, 0.0) if why else await run_one(check, ctx)
            )
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        for close in reversed(ctx.closers):
            await close()
    return results


__all__ = ["ALL_CHECKS", "Check", "CheckFailed", "Result", "Role", "Status", "Target", "run_checks"]
