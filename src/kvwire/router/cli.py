"""``kvwire serve router``: the OpenAI-compatible router in front of prefill and decode engines.

Options come from flags, ``KVWIRE_<OPTION>`` variables and ``--config`` (``kvwire.options``). The router
binds its port before it probes any engine: a port in use ends it with one line, and it never takes the
process that holds its port for one of its engines.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from typing import Any

from kvwire.config import (
    LOCAL_PREFILL_MAX_TOKENS,
    Disaggregation,
    EngineKind,
    Policy,
    RouterConfig,
    split_urls,
)
from kvwire.discovery.source import check_target, redact
from kvwire.errors import ConfigError, KvwireError
from kvwire.logsetup import LogFormat, configure
from kvwire.options import Command, Option, discovery_option, logging_options
from kvwire.protocol.messages import TransferMode
from kvwire.router import dialects
from kvwire.startup import bind_tcp, fail, record_stops

log = logging.getLogger("kvwire.router")
R = frozenset({Command.ROUTER})


def router_options() -> list[Option]:
    return [
        Option("prefill", list, None, "prefill engine URL (repeat or comma-separate); required without "
               "--discovery", R),
        Option("decode", list, None, "decode engine URL (repeat or comma-separate); required without "
               "--discovery", R),
        discovery_option(R),
        Option("host", str, "127.0.0.1", "address to bind", R),
        Option("port", int, 8000, "port to bind", R),
        Option("policy", str, Policy.ROUND_ROBIN.value, "picks P and D", R, tuple(p.value for p in Policy)),
        Option(
            "disaggregation", str, Disaggregation.ALWAYS.value, "always: every request through a prefill "
            "engine; conditional: the decode engine prefills a request itself when its prompt is at most "
            "--local-prefill-max-tokens or the prefill engine has more prompt tokens queued than it",
            R, tuple(d.value for d in Disaggregation),
        ),
        Option(
            "local_prefill_max_tokens", int, LOCAL_PREFILL_MAX_TOKENS, "under --disaggregation conditional: "
            "prompts of at most this many tokens are prefilled on the decode engine", R,
        ),
        Option(
            "mode", str, TransferMode.PUSH.value, "KV transfer mode of the engines: push sends both legs at "
            "once, pull sends P's first", R, tuple(m.value for m in TransferMode),
        ),
        Option("model", str, "kvwire", "model name served (the engines' names are served too)", R),
        Option(
            "request_timeout", float, 300.0,
            "seconds to wait for an answer: a unary one whole; a stream's first token, then each next "
            "event (a long stream still arriving is never cut)", R,
        ),
        Option("connect_timeout", float, 5.0, "seconds to connect to an engine", R),
        Option(
            "max_requests", int, 2048, "requests in flight at once (each holds up to two engine "
            "connections); one more is refused 503 at once, which OpenAI clients retry", R,
        ),
        Option("health_interval", float, 2.0, "seconds between engine health checks", R),
        Option("health_timeout", float, 2.0, "seconds one health check may take", R),
        Option(
            "engines", str, dialects.DEFAULT_KIND, f"what the engines are: {dialects.help_text()}", R,
            dialects.names(),
        ),
        Option(
            "api_key", str, None, "key clients of the router's /v1 API must send (Authorization: Bearer)",
            R, env="KVWIRE_ROUTER_API_KEY", default_text="none: no key asked",
        ),
        Option(
            "engine_api_key", str, None, "key the router sends to the engines (their --api-key)", R,
            env="KVWIRE_API_KEY", default_text="none",
        ),
        Option(
            "router_token", str, None, "token the router sends on its legs; engines started with the same "
            "--router-token take kv_transfer_params only from the router", R, default_text="none",
        ),
        *logging_options(R),
    ]  # fmt: skip


def config_from_values(values: dict[str, Any]) -> RouterConfig:
    for name in ("prefill", "decode"):
        if not values[name] and not values["discovery"]:
            raise ConfigError(
                f"the router needs --{name} URL (or KVWIRE_{name.upper()}, or '{name}' in --config), "
                "or --discovery etcd://HOST:PORT to find its engines there"
            )
    if values["discovery"]:
        check_target(values["discovery"], client=True)
    return RouterConfig(
        prefill_urls=split_urls(values["prefill"] or []),
        decode_urls=split_urls(values["decode"] or []),
        discovery=values["discovery"],
        policy=Policy(values["policy"]),
        disaggregation=Disaggregation(values["disaggregation"]),
        local_prefill_max_tokens=values["local_prefill_max_tokens"],
        mode=TransferMode(values["mode"]),
        host=values["host"],
        port=values["port"],
        model=values["model"],
        request_timeout_s=values["request_timeout"],
        connect_timeout_s=values["connect_timeout"],
        max_requests=values["max_requests"],
        health_interval_s=values["health_interval"],
        health_timeout_s=values["health_timeout"],
        engines=EngineKind(values["engines"]),
        api_key=values["api_key"],
        engine_api_key=values["engine_api_key"],
        router_token=values["router_token"],
    )


def summary(config: RouterConfig, port: int) -> str:
    return "; ".join(
        [
            f"router serving http://{config.host}:{port}",
            f"prefill {', '.join(config.prefill_urls) or '-'}",
            f"decode {', '.join(config.decode_urls) or '-'}",
            f"discovery {redact(config.discovery) if config.discovery else 'none'}",
            f"mode {config.mode.value}",
            f"policy {config.policy.value}",
            _disaggregation(config),
            f"engines {config.engines}",
            f"api key {'set' if config.api_key else 'not set'}",
            f"engine api key {'set' if config.engine_api_key else 'not set'}",
        ]
    )


def _disaggregation(config: RouterConfig) -> str:
    if config.disaggregation is Disaggregation.ALWAYS:
        return "disaggregation always"
    return f"disaggregation conditional (local prefill up to {config.local_prefill_max_tokens} tokens)"


# File descriptors a request in flight may hold (its client's connection and two legs), and what the router
# holds besides (its listener, the health polls' pool, etcd, logs).
_FDS_PER_REQUEST = 3
_FDS_BESIDES = 512


def fit_open_files(config: RouterConfig) -> RouterConfig:
    """Raise this process's open-file limit to what ``--max-requests`` needs (up to the hard limit, as
    vLLM's servers do); past the hard limit, lower ``max_requests`` to fit, with a warning naming the fix.
    The router kept at most 512 engine connections before ``--max-requests``: with 2,048 requests allowed,
    a soft limit of 1,024 (a common default) would fail sockets with EMFILE instead."""
    need = config.max_requests * _FDS_PER_REQUEST + _FDS_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        soft = ceiling
    if soft == resource.RLIM_INFINITY or soft >= need:
        return config
    fits = max(1, (soft - _FDS_BESIDES) // _FDS_PER_REQUEST)
    log.warning(
        "--max-requests %d needs %d open files, the limit is %d (ulimit -n): serving %d at once; raise the "
        "hard limit to allow more", config.max_requests, need, soft, fits,
    )  # fmt: skip
    return dataclasses.replace(config, max_requests=fits)


def run_router(values: dict[str, Any]) -> int:
    """Serve the router with its resolved options (``kvwire.serve`` resolves them) until a signal."""
    try:
        configure(values["log_level"], LogFormat(values["log_format"]), values["log_http"])
        config = fit_open_files(config_from_values(values))
        sock = bind_tcp(config.host, config.port, "HTTP", "stop it or pass another --port")
    except KvwireError as exc:
        return fail("kvwire serve router", exc)
    import uvicorn

    from kvwire.router.app import create_app

    port = sock.getsockname()[1]
    log.info("%s", summary(config, port))
    app = create_app(config)
    server_config = uvicorn.Config(
        app, host=config.host, port=port, log_config=None, access_log=values["log_http"], lifespan="on"
    )
    userver = uvicorn.Server(server_config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler installed
    # before it: the default one killed the process (status 143 after a clean SIGTERM, where supervisors
    # and `kvwire serve` engines see 0). This one records it, so a requested stop exits with status 0.
    stopped_by = record_stops(userver)
    userver.run(sockets=[sock])
    if stopped_by:
        log.info("router stopped by signal %d", stopped_by[0])
    return 0
