"""The servers' command lines: a parser per role, help and defaults on every flag, every connector knob
settable by flag, environment and config file, with flag > environment > file > default."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from kvwire.cli import build_parser
from kvwire.connector import ConnectorConfig
from kvwire.engine.options import connector_config
from kvwire.errors import ConfigError
from kvwire.options import Command
from kvwire.protocol.messages import TransferMode
from kvwire.router.cli import config_from_values
from kvwire.serve import values_for

ROLES = ("prefill", "decode", "colocated", "router")
PREFILL_ONLY = ("--pp", "--kv-lease-duration-s", "--tombstone-s", "--max-early-registrations")


def _sub(role: str) -> argparse.ArgumentParser:
    argv = ["serve", role]
    parser = build_parser(argv)
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    sub = next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices[role]
    assert isinstance(sub, argparse.ArgumentParser)
    return sub


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("role", ROLES)
def test_every_flag_has_help_and_shows_its_default(role: str) -> None:
    parser = _sub(role)
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{role}: {action.option_strings} has no help"
        assert "default" in action.help, f"{role}: {action.option_strings} does not show its default"
    assert (
        "--log-level" in _flags(parser) and "--log-format" in _flags(parser) and "--config" in _flags(parser)
    )


def test_decode_help_shows_no_prefill_only_flag() -> None:
    prefill, decode = _flags(_sub("prefill")), _flags(_sub("decode"))
    for flag in PREFILL_ONLY:
        assert flag in prefill and flag not in decode
    assert "--kv-load-failure-policy" in decode and "--kv-load-failure-policy" not in prefill
    assert "--side-channel-port" not in _flags(_sub("colocated"))
    assert "--fence-ms" not in _flags(_sub("router"))


def test_every_connector_knob_is_a_flag_of_the_engines() -> None:
    flags = _flags(_sub("prefill")) | _flags(_sub("decode"))
    for f in dataclasses.fields(ConnectorConfig):
        if f.name not in ("mode", "layerwise"):  # --mode; layerwise: a vLLM setting (no layers reported here)
            assert "--" + f.name.replace("_", "-") in flags, f.name
    assert "--layerwise" not in flags


def _values(role: str, argv: list[str], environ: dict[str, str] | None = None) -> dict[str, object]:
    args = build_parser(["serve", role, *argv]).parse_args(["serve", role, *argv])
    return values_for(args, Command(role), environ or {})


def test_precedence_is_flag_then_environment_then_file_then_default(tmp_path: Path) -> None:
    path = tmp_path / "kvwire.toml"
    path.write_text(
        "fence_ms = 100\nliveness_timeout_s = 9.0\nheartbeat_interval_s = 2\n[decode]\nfence_ms = 150\n"
    )
    env = {"KVWIRE_FENCE_MS": "200", "KVWIRE_LIVENESS_TIMEOUT_S": "8"}
    both = _values("decode", ["--config", str(path), "--fence-ms", "300"], env)
    assert both["fence_ms"] == 300  # flag over environment over file
    assert both["liveness_timeout_s"] == 8.0  # environment over file
    assert both["heartbeat_interval_s"] == 2.0  # file over default
    assert both["handshake_timeout_s"] == 5.0  # default
    assert _values("decode", ["--config", str(path)])["fence_ms"] == 150  # [decode] over the top level
    assert _values("prefill", ["--config", str(path)])["fence_ms"] == 100
    assert _values("decode", [], {"KVWIRE_CONFIG": str(path)})["fence_ms"] == 150
    assert (
        _values("router", ["--prefill", "p", "--decode", "d"], {"KVWIRE_LOG_LEVEL": "DEBUG"})["log_level"]
        == "debug"
    )


def test_a_config_file_sets_every_connector_knob(tmp_path: Path) -> None:
    """Each knob given a value that is not its default, in JSON: the connector gets them all."""
    wanted: dict[str, object] = {}
    for f in dataclasses.fields(ConnectorConfig):
        if f.name in ("mode", "layerwise"):  # layerwise: not a setting of kvwire's engines
            continue
        if f.name == "kv_load_failure_policy":
            wanted[f.name] = "recompute"
        elif f.name == "allowed_peers":
            wanted[f.name] = "10.0.0.0/8,p0.cluster"
        elif isinstance(f.default, bool):
            wanted[f.name] = not f.default
        else:
            wanted[f.name] = f.default * 3 if f.default else 1  # type: ignore[operator]
    wanted["liveness_timeout_s"] = 100.0  # still above 3 x the heartbeat
    path = tmp_path / "kvwire.json"
    path.write_text(json.dumps(wanted))
    values = {**_values("prefill", ["--config", str(path)]), **_values("decode", ["--config", str(path)])}
    config = connector_config(values, TransferMode.PULL)
    for name, value in wanted.items():
        got = getattr(config, name)
        assert (got.value if hasattr(got, "value") else got) == value, name
    assert config.mode is TransferMode.PULL


def test_config_file_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("fence_msec = 3\n")
    with pytest.raises(ConfigError, match="unknown option 'fence_msec'"):
        _values("decode", ["--config", str(path)])
    path.write_text('fence_ms = "soon"\n')
    with pytest.raises(ConfigError, match="fence_ms"):
        _values("decode", ["--config", str(path)])
    path.write_text('mode = "sideways"\n')
    with pytest.raises(ConfigError, match="push, pull"):
        _values("decode", ["--config", str(path)])
    path.write_text("[oops\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        _values("decode", ["--config", str(path)])
    # Another role's option is ignored: one file may describe the whole deployment.
    path.write_text('tombstone_s = 5.0\nprefill = ["http://p:8100"]\n')
    assert "tombstone_s" not in _values("decode", ["--config", str(path)])


def test_router_options_from_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        'prefill = ["p1:8100", "p2:8100"]\ndecode = ["d1:8200"]\nmode = "pull"\n[router]\nport = 9000\n'
    )
    config = config_from_values(_values("router", ["--config", str(path), "--decode", "d2:8200,d3:8200"]))
    assert config.prefill_urls == ("http://p1:8100", "http://p2:8100")
    assert config.decode_urls == ("http://d2:8200", "http://d3:8200")
    assert (config.mode, config.port) == (TransferMode.PULL, 9000)
    keys = config_from_values(
        _values("router", ["--prefill", "p", "--decode", "d"], {"KVWIRE_API_KEY": "k3y"})
    )
    assert (keys.engine_api_key, keys.api_key) == ("k3y", None)
    assert "k3y" not in repr(keys)
    with pytest.raises(ConfigError, match="--prefill"):
        config_from_values(_values("router", ["--decode", "d"]))
