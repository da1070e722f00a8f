"""Command-line options of the server roles, their config file, and the precedence between sources.

Every option of ``kvwire serve prefill|decode|colocated|router`` is declared once here (``Option``): its
flag, its environment variable, its config-file key, its default, its help and the roles that have it.
One value is taken from the first source that sets it:

    command-line flag  >  environment variable  >  config file (``--config PATH``)  >  default

The config file is TOML (``.toml``) or JSON (any other name): a flat table of ``key = value`` (the flag's
name with ``_`` for ``-``), plus optional tables ``[prefill]``, ``[decode]``, ``[colocated]``, ``[router]``
whose keys apply to that role only and win over the top-level ones. A key no role knows is an error; a key
of another role is ignored, so one file can describe a whole deployment.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvwire.errors import ConfigError
from kvwire.logsetup import LOG_LEVELS
from kvwire.logsetup import LogFormat as LogFormat


class Command(enum.Enum):
    """The roles a ``kvwire serve`` process plays; each has its own parser."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    ROUTER = "router"


P, D, C, R = Command.PREFILL, Command.DECODE, Command.COLOCATED, Command.ROUTER
ENGINES = frozenset({P, D, C})
CONNECTED = frozenset({P, D})
EVERY = frozenset(Command)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Option:
    """One option. ``kind`` is ``int``, ``float``, ``str``, ``bool`` (a switch) or ``list`` (strings:
    a repeatable flag, a comma-separated environment value, a list in the file)."""

    name: str
    kind: type
    default: Any
    help: str
    commands: frozenset[Command]
    choices: tuple[str, ...] | None = None
    env: str | None = None  # default: KVWIRE_<NAME>
    aliases: tuple[str, ...] = ()
    # Per-role defaults where they differ (the engines' HTTP ports).
    role_defaults: Mapping[Command, Any] = dataclasses.field(default_factory=dict)
    # Shown instead of the default value in --help (a computed default, or a secret).
    default_text: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_name(self) -> str:
        return self.env or "KVWIRE_" + self.name.upper()

    def default_for(self, command: Command) -> Any:
        return self.role_defaults.get(command, self.default)


def _type_of(opt: Option) -> Any:
    return list[str] if opt.kind is list else opt.kind


def parse_text(opt: Option, text: str, source: str) -> Any:
    """A flag's or environment variable's string as the option's type."""
    try:
        if opt.kind is bool:
            low = text.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE[:-1])}")
            value: Any = low in _TRUE
        elif opt.kind is list:
            value = [part.strip() for part in text.split(",") if part.strip()]
        elif opt.choices is not None:
            value = text.strip().lower()  # KVWIRE_LOG_LEVEL=DEBUG as well as debug
        else:
            value = opt.kind(text)
    except ValueError as exc:
        raise ConfigError(f"{source}={text!r}: not a valid {opt.kind.__name__} ({exc})") from None
    return check_choice(opt, value, source)


def check_choice(opt: Option, value: Any, source: str) -> Any:
    if opt.choices is not None and value is not None and value not in opt.choices:
        raise ConfigError(f"{source}={value!r}: expected one of {', '.join(opt.choices)}")
    return value


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option], command: Command) -> None:
    """Flags of ``command``, each with its help, its default and where else it can be set."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="TOML (.toml) or JSON file of options (keys are the flag names with _ for -); "
        "precedence: flag > environment > file > default (default: KVWIRE_CONFIG, else none)",
    )
    for opt in options:
        if command not in opt.commands:
            continue
        default = opt.default_for(command)
        shown = opt.default_text or ("none" if default is None else str(default))
        text = f"{opt.help} (env {opt.env_name}; default: {shown})"
        # SUPPRESS: an option absent from the namespace was not given, so the environment or file may set it.
        common: dict[str, Any] = {"default": argparse.SUPPRESS, "help": text, "dest": opt.name}
        flags = [opt.flag, *opt.aliases]
        if opt.kind is bool:
            parser.add_argument(*flags, action="store_true", **common)
        elif opt.kind is list:
            parser.add_argument(*flags, action="append", metavar="VALUE", **common)
        else:
            kind = opt.kind
            parser.add_argument(*flags, type=kind, choices=opt.choices, metavar=_metavar(opt), **common)


def _metavar(opt: Option) -> str:
    if opt.choices is not None:
        return "{" + ",".join(opt.choices) + "}"
    seconds = opt.name.endswith("_s") or any(w in opt.name for w in ("timeout", "interval"))
    return {int: "N", float: "SECONDS" if seconds else "X"}.get(opt.kind, "TEXT")


def load_file(path: Path) -> dict[str, Any]:
    """A config file's top-level table (TOML for ``.toml``, else JSON)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ConfigError(f"--config {path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a table of options")
    return data


def file_values(
    data: Mapping[str, Any],
    options: Sequence[Option],
    command: Command,
    path: Path,
    every_name: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The file's values for ``command``: top-level keys, then its own ``[role]`` table over them.
    A key in ``every_name`` (another role's options) is skipped, any other unknown key is an error."""
    known = {o.name: o for o in options}
    everyone = every_name | known.keys()
    roles = {c.value for c in Command}
    merged: dict[str, Any] = {}
    for scope in (data, data.get(command.value) or {}):
        if not isinstance(scope, dict):
            raise ConfigError(f"--config {path}: [{command.value}] must be a table")
        for key, value in scope.items():
            if key in roles and scope is data and isinstance(value, dict):
                continue  # a role's own table (the router's prefill/decode options are lists)
            opt = known.get(key)
            if opt is None and key not in everyone:
                raise ConfigError(f"--config {path}: unknown option {key!r} (keys are flag names with _)")
            if opt is None or command not in opt.commands:
                continue  # another role's option: one file may describe the whole deployment
            try:
                value = msgspec.convert(value, _type_of(opt))
            except msgspec.ValidationError as exc:
                raise ConfigError(f"--config {path}: {key}: {exc}") from None
            merged[key] = check_choice(opt, value, f"--config {path}: {key}")
    return merged


def resolve(
    args: argparse.Namespace,
    options: Sequence[Option],
    command: Command,
    environ: Mapping[str, str],
    every_name: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Every option of ``command``, from the first source that sets it (flag > env > file > default).
    ``every_name``: the option names of every role (``kvwire.serve``), which a shared config file may hold."""
    path_text = getattr(args, "config", None) or environ.get("KVWIRE_CONFIG") or None
    from_file: dict[str, Any] = {}
    if path_text:
        path = Path(path_text)
        from_file = file_values(load_file(path), options, command, path, every_name)
    values: dict[str, Any] = {}
    for opt in options:
        if command not in opt.commands:
            continue
        if hasattr(args, opt.name):
            value = getattr(args, opt.name)
            if opt.kind is list:  # each flag may itself be comma-separated
                value = [part.strip() for item in value for part in item.split(",") if part.strip()]
        elif environ.get(opt.env_name):
            value = parse_text(opt, environ[opt.env_name], opt.env_name)
        elif opt.name in from_file:
            value = from_file[opt.name]
        else:
            value = opt.default_for(command)
        values[opt.name] = value
    return values


def logging_options(commands: frozenset[Command]) -> list[Option]:
    """``--log-level``, ``--log-format`` and ``--log-http``: every role has them."""
    return [
        Option("log_level", str, "info", "log level", commands, choices=LOG_LEVELS),
        Option(
            "log_format",
            str,
            LogFormat.TEXT.value,
            "log format on stderr: text lines, or one JSON object a line (fields: ts, level, logger, msg, "
            "and transfer_id where a line is about one)",
            commands,
            choices=tuple(f.value for f in LogFormat),
        ),
        Option(
            "log_http",
            bool,
            False,
            "also log the HTTP libraries (aiohttp, httpx, httpcore, uvicorn's access log) at --log-level; "
            "otherwise they log warnings only",
            commands,
        ),
    ]


def discovery_option(commands: frozenset[Command]) -> Option:
    """``--discovery etcd://HOST:PORT[/prefix]``: the engines register there, the router watches there."""
    return Option(
        "discovery",
        str,
        None,
        "etcd://HOST:PORT[/prefix] (prefix default /kvwire; etcds://...?ca=CA&cert=CERT&key=KEY over TLS): "
        "engines register under a lease there and the router routes to the engines registered there, "
        "besides any --prefill/--decode URLs",
        commands,
        default_text="none: static URLs only",
    )
