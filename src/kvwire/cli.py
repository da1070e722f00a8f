"""The ``kvwire`` command line.

Each command lives in its own module, imported only when that command runs (no import-time side
effects, and ``kvwire --help`` stays fast). A command module exposes ``add_arguments(parser)`` (or
``add_arguments_for(parser, path)`` when it serves several commands) and ``run(args) -> int`` (the exit
status).

The tools' commands (``bench ...``, ``demo``, ``chaos``, ``transport-demo``) live in ``kvwire_tools``, a
package beside the library that the built package leaves out: where it is absent they are still listed,
and running one says how to get it (``TOOLS_FIX``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

# (command path, module, help). Nested commands are written "bench transfer".
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "kvwire_tools.demo.cli", "run P, D and the router on localhost and check the answers"),
    ("serve prefill", "kvwire.serve", "run a prefill engine server"),
    ("serve decode", "kvwire.serve", "run a decode engine server"),
    ("serve colocated", "kvwire.serve", "run a colocated (prefill and decode) engine server"),
    ("serve router", "kvwire.serve", "run the OpenAI-compatible router"),
    ("bench transfer", "kvwire_tools.bench.transfer", "raw NIXL WRITE and kvwire push against np.copyto"),
    ("bench descriptors", "kvwire_tools.bench.descriptors", "descriptor counts and post times"),
    (
        "bench handshake",
        "kvwire_tools.bench.handshake",
        "notif-only vs full handshakes; a dead peer among many",
    ),
    ("bench e2e", "kvwire_tools.bench.e2e", "TTFT disaggregated vs colocated"),
    ("bench overhead", "kvwire_tools.bench.overhead", "control-plane CPU time per request"),
    (
        "bench short",
        "kvwire_tools.bench.short",
        "a short request disaggregated vs colocated; idle engines' CPU",
    ),
    (
        "bench fleet",
        "kvwire_tools.bench.fleet",
        "a 2P2D fleet on etcd: steady, join, drain, rolling restart, kill; routing",
    ),
    (
        "bench flood",
        "kvwire_tools.bench.flood",
        "a rogue peer floods P with notifications while real requests run",
    ),
    ("bench vllm", "kvwire_tools.bench.vllm", "kvwire vs vLLM's NIXL push connector in real vLLM engines"),
    (
        "bench gpu-check",
        "kvwire_tools.bench.gpu_check",
        "push and pull between two processes on a GPU (or CPU), bytes compared",
    ),
    ("sim", "kvwire.testing.sim.cli", "deterministic simulation of the cores under faults, in virtual time"),
    ("chaos", "kvwire_tools.chaos", "kill and restart peers under load; count leaks and corruption"),
    (
        "conformance",
        "kvwire.testing.protocol_conformance.cli",
        "check an engine's side channel and notifications against the wire contract (docs/protocol.md)",
    ),
    ("transport-demo", "kvwire_tools.demo.transport", "two processes, one NIXL WRITE with a notification"),
)


TOOLS = "kvwire_tools"
TOOLS_FIX = "from a checkout of kvwire's repository: pip install -e '.[tools]'"


def _is_tool(module: str) -> bool:
    return module.split(".")[0] == TOOLS


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _chosen(argv: Sequence[str]) -> str | None:
    """The command path that argv starts with, so only that command's module is imported."""
    words = [w for w in argv if not w.startswith("-")]
    for path, _module, _help in COMMANDS:
        if words[: len(path.split())] == path.split():
            return path
    return None


def _missing_tool(path: str | None) -> str | None:
    """Why the tool command ``path`` cannot run here, or None (not a tool, or its package is there)."""
    module = next((m for p, m, _h in COMMANDS if p == path), None)
    if module is None or not _is_tool(module) or _module_available(module):
        return None
    return f"kvwire {path}: kvwire's tools ({TOOLS}) are not installed; {TOOLS_FIX}"


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvwire")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire", description="Move KV caches from prefill to decode.")
    parser.add_argument("--version", action="version", version=f"kvwire {_version()}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    chosen = _chosen(argv)
    for path, module, help_text in COMMANDS:
        if not _module_available(module):
            if not _is_tool(module):
                continue
            help_text = f"{help_text} (needs kvwire's tools: {TOOLS_FIX})"
        words = path.split()
        subs = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(
                    dest="subcommand", metavar="SUBCOMMAND", required=True
                )
            subs = groups[words[0]]
        # Defaults shown in every command's --help (options whose help names its default are left as is).
        sub = subs.add_parser(
            words[-1],
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        sub.set_defaults(_module=module, _path=path)
        if path == chosen and _module_available(module):
            mod = importlib.import_module(module)
            # A module serving several commands gives each its own flags (decode's help: no prefill flag).
            per_command = getattr(mod, "add_arguments_for", None)
            if per_command is not None:
                per_command(sub, path)
            else:
                mod.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before numpy loads: each engine process computes on one core; BLAS threads of several processes
    # fighting over a few cores made a 2k-token prefill 6x slower. An explicit setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    missing = _missing_tool(_chosen(argv))
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 2
    status: int = importlib.import_module(module).run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
