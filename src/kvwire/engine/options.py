"""The options of ``kvwire serve prefill|decode|colocated`` (see ``kvwire.options`` for the sources).

Every ``ConnectorConfig`` field is an option of the engines that use it, under its own name
(``--fence-ms``, ``--handshake-timeout-s``, ...): a field added to ``ConnectorConfig`` gets a flag, an
environment variable and a config-file key without an edit here (``CONNECTOR_HELP`` gives it a better help).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import urllib.parse
from typing import Any

from kvwire.config import DEFAULT_BACKEND
from kvwire.core.config import ConnectorConfig
from kvwire.engine.config import PRESETS
from kvwire.errors import ConfigError
from kvwire.options import CONNECTED, ENGINES, Command, Option, discovery_option, logging_options
from kvwire.protocol.messages import TransferMode
from kvwire.transport.registry import names as transport_names

P, D, C = Command.PREFILL, Command.DECODE, Command.COLOCATED

# What each connector knob does, and which engine uses it (both when absent).
CONNECTOR_HELP: dict[str, tuple[str, frozenset[Command]]] = {
    "kv_lease_duration_s": ("P keeps a finished request's blocks this long for D", frozenset({P})),
    "fence_ms": ("no write starts later than this after the push_reg (P uses the smaller of P's, D's)",
                 CONNECTED),
    "heartbeat_interval_s": ("how often heartbeats go to peers with live transfers", CONNECTED),
    "liveness_timeout_s": ("a peer silent this long while transfers are live is dead", CONNECTED),
    "dead_peer_grace_s": ("D reuses a dead peer's registered blocks only after this", frozenset({D})),
    "dead_quarantine_s": ("after the grace, a dead P's blocks stay quarantined until that P life is "
                          "confirmed gone or speaks again, at most this long", frozenset({D})),
    "transfer_timeout_s": ("a posted transfer still running after this is released and failed", CONNECTED),
    "engine_ttl_s": ("peers unused this long are forgotten (agents removed)", CONNECTED),
    "kv_load_failure_policy": ("when the KV does not arrive: answer an error (fail) or prefill locally "
                               "(recompute)", frozenset({D})),
    "handshake_timeout_s": ("one whole handshake with a peer (every attempt and the agent load)", CONNECTED),
    "handshake_retries": ("further attempts after a failed one, within that deadline", CONNECTED),
    "poll_interval_s": ("connector loop period while transfers are live", CONNECTED),
    "idle_poll_interval_s": ("connector loop period when idle", CONNECTED),
    "tombstone_s": ("how long P remembers an ended registration", frozenset({P})),
    "max_early_registrations": ("P: registrations waiting for their prefill at most; more are dropped",
                                frozenset({P})),
    "max_early_registrations_per_peer": ("P: of those, from one D engine life at most", frozenset({P})),
    "max_served_ids": ("D: transfer ids remembered as served, so a request reusing one is refused",
                       frozenset({D})),
    "max_early_block_ids": ("P: D's block ids the early registrations name, in all", frozenset({P})),
    "max_tombstones": ("P: ended requests remembered at most", frozenset({P})),
    "max_registrations_per_request": ("P: registrations and remembered cancels one request holds",
                                      frozenset({P})),
    "max_registrations": ("P: registrations and remembered cancels in all, tombstones' included",
                          frozenset({P})),
    "max_block_ids": ("P: D's block ids all registrations hold at once", frozenset({P})),
    "kv_digest_sample": ("D: share of requests whose KV bytes are checked against P's digest (0: none, "
                         "1: all; costs CPU on both sides)", frozenset({D})),
    "allowed_peers": ("peers this engine may dial: CIDRs, addresses, host names, comma-separated (empty: "
                      "any; with no secret, set it)", CONNECTED),
}  # fmt: skip
# Set by other options: the mode is --mode (P, D and the router agree on it). Not offered: layerwise (a
# vLLM connector option; kvwire's engine prefills in one call and reports no layer: it was accepted and
# did nothing).
_NOT_KNOBS = frozenset({"mode", "layerwise"})


def _connector_options() -> list[Option]:
    out = []
    for f in dataclasses.fields(ConnectorConfig):
        if f.name in _NOT_KNOBS:
            continue
        text, commands = CONNECTOR_HELP.get(f.name, (f"ConnectorConfig.{f.name}", CONNECTED))
        default: Any = f.default
        choices = None
        kind: type = type(default)
        if isinstance(default, enum.Enum):
            choices = tuple(str(m.value) for m in type(default))
            default, kind = default.value, str
        aliases = ("--kv-lease-s",) if f.name == "kv_lease_duration_s" else ()
        out.append(Option(f.name, kind, default, text, commands, choices=choices, aliases=aliases))
    return out


def engine_options() -> list[Option]:
    return [
        Option(
            "host",
            str,
            "127.0.0.1",
            "HTTP and side-channel bind address; without KVWIRE_SECRET a non-loopback one needs --insecure",
            ENGINES,
        ),
        Option("port", int, None, "HTTP port", ENGINES, role_defaults={P: 8100, D: 8200, C: 8300}),
        Option("side_channel_port", int, 0, "side-channel port; 0: any free port (see /health)", CONNECTED),
        Option("preset", str, "tiny", "model preset (see the docs)", ENGINES, tuple(sorted(PRESETS))),
        Option("tp", int, 1, "tensor-parallel size (KV heads sharded over ranks)", ENGINES),
        Option("pp", int, 1, "pipeline-parallel size (the decode side has none)", frozenset({P, C})),
        Option(
            "backend", str, DEFAULT_BACKEND, "transfer backend (inproc: one process, tests)", CONNECTED,
            transport_names(),
        ),
        Option(
            "mode", str, TransferMode.PUSH.value, "KV transfer mode: P pushes, or D pulls (P, D and the "
            "router must agree)", CONNECTED, tuple(m.value for m in TransferMode),
        ),
        Option("seed", int, 0, "weights seed (P, D and a colocated reference must agree)", ENGINES),
        Option("num_blocks", int, None, "KV blocks in the cache", ENGINES, default_text="the preset's"),
        Option("max_num_seqs", int, 64, "requests running at once", ENGINES),
        Option("prefix_cache", bool, False, "keep whole prompt blocks after a request and reuse them for "
               "prompts with the same prefix (answers unchanged: docs/fleet.md)", frozenset({P, C})),
        Option("engine_id", str, None, "the engine's id on the wire", ENGINES, default_text="ROLE-<random>"),
        Option(
            "api_key", str, None, "key every /v1 request must carry (Authorization: Bearer KEY)", ENGINES,
            default_text="none: no key asked",
        ),
        Option(
            "served_model_name", str, "kvwire", "further model names the engine answers to, comma-separated "
            "(its own, kvwire-PRESET, always); a request naming another gets 404 model_not_found", ENGINES,
        ),
        Option(
            "router_token", str, None, "token the router sends on its legs (header x-kvwire-router-token); "
            "when set, kv_transfer_params are refused (403) on requests without it", ENGINES,
            default_text="none: any client may send kv_transfer_params",
        ),
        Option(
            "insecure", bool, False, "allow a non-loopback --host without KVWIRE_SECRET: anyone who reaches "
            "the side channel can then read the cache layout and write into D's KV", ENGINES,
        ),
        discovery_option(CONNECTED),
        Option("discovery_ttl", int, 5, "seconds the engine's etcd lease lives without renewal (a killed "
               "engine leaves the routers' view after at most this)", CONNECTED),
        Option("advertise_url", str, None, "the HTTP URL routers reach this engine at (registered in etcd)",
               CONNECTED, default_text="http://HOST:PORT, HOST from KVWIRE_SIDE_CHANNEL_HOST or --host"),
        Option("drain_timeout", float, 30.0, "under --discovery, SIGTERM drains: seconds at most to finish "
               "in-flight requests before stopping", CONNECTED),
        *_connector_options(),
        *logging_options(ENGINES),
    ]  # fmt: skip


def check_fleet_options(values: dict[str, Any]) -> None:
    """``ConfigError`` naming a bad ``--discovery-ttl``, ``--drain-timeout`` or ``--advertise-url``, so that
    start-up ends before anything listens: before, a TTL of 0 raised out of the registrar after NIXL was
    built and the port served, a negative drain timeout was taken, and a URL without its scheme was
    registered for every router to fail its requests on (502)."""
    ttl = values.get("discovery_ttl", 5)
    if ttl < 1:
        raise ConfigError(f"--discovery-ttl {ttl}: the etcd lease's TTL is at least 1 s")
    drain = values.get("drain_timeout", 0.0)
    if not math.isfinite(drain) or drain < 0:
        raise ConfigError(f"--drain-timeout {drain}: expected seconds, 0 or more")
    url = values.get("advertise_url")
    if url is not None:
        check_advertise_url(url)


def check_advertise_url(url: str) -> None:
    """Routers call ``URL/v1/...`` and ``URL/health``: it must be ``http(s)://HOST[:PORT]``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--advertise-url {url!r}: expected http://HOST:PORT (what routers dial)")
    try:
        port = parts.port
    except ValueError:
        port = 0  # not a number, or out of range
    if port == 0 or parts.username is not None or parts.path.strip("/") or parts.query or parts.fragment:
        raise ConfigError(
            f"--advertise-url {url!r}: expected http://HOST:PORT with a port of 1-65535 and nothing after it"
        )


def connector_config(values: dict[str, Any], mode: TransferMode) -> ConnectorConfig:
    """The ``ConnectorConfig`` of resolved option values (fields of the other role keep their defaults)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ConnectorConfig):
        if f.name in values and f.name not in _NOT_KNOBS:
            default = f.default
            value = values[f.name]
            kwargs[f.name] = type(default)(value) if isinstance(default, enum.Enum) else value
    return ConnectorConfig(mode=mode, **kwargs)
