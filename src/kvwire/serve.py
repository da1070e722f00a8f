"""``kvwire serve prefill|decode|colocated|router``: one role's options, then that role.

The one module that knows every role. Options come from flags, the environment and one ``--config`` file
that may describe a whole deployment, so a file key is an error only when no role has it
(``kvwire.options``). The roles (``kvwire.engine.serve``, ``kvwire.router.cli``) know their own options
only, and never import each other or this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvwire.config import process_environ
from kvwire.engine.options import engine_options
from kvwire.errors import KvwireError
from kvwire.options import Command, Option, add_options, resolve
from kvwire.router.cli import router_options
from kvwire.startup import fail


def role_options(command: Command) -> list[Option]:
    """The option table of one role."""
    return router_options() if command is Command.ROUTER else engine_options()


def all_option_names() -> frozenset[str]:
    """The option names of every role (a config file may hold any of them)."""
    return frozenset(o.name for o in (*engine_options(), *router_options()))


def add_arguments_for(parser: argparse.ArgumentParser, path: str) -> None:
    """The flags of one role only (decode's help shows no prefill-only flag)."""
    command = Command(path.split()[-1])
    add_options(parser, role_options(command), command)


def values_for(args: argparse.Namespace, command: Command, environ: Mapping[str, str]) -> dict[str, Any]:
    """Every option of ``command``: flag > environment > config file > default."""
    return resolve(args, role_options(command), command, environ, all_option_names())


def run(args: argparse.Namespace) -> int:
    command = Command(str(args._path).split()[-1])
    try:
        values = values_for(args, command, process_environ())
    except KvwireError as exc:
        return fail(f"kvwire serve {command.value}", exc)
    if command is Command.ROUTER:
        from kvwire.router.cli import run_router

        return run_router(values)
    from kvwire.engine.config import Role
    from kvwire.engine.serve import run_engine

    return run_engine(values, Role(command.value))
