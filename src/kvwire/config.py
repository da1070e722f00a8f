"""Typed configuration, and the only place that reads environment variables.

Environment variables (all optional):

* ``KVWIRE_SECRET``: shared secret for side-channel authentication (HMAC); unset means no authentication.
* ``KVWIRE_SIDE_CHANNEL_HOST``: the address an engine advertises for its side channel (what peers on
  other hosts connect to); default: the host it binds.
* ``KVWIRE_LOG_LEVEL``: ``debug``, ``info`` (default), ``warning`` or ``error``.

The server roles' options (``kvwire.options``) are also read from ``KVWIRE_<OPTION>`` variables, through
``process_environ()``.

Command modules build the dataclasses below from their flags and ``env_config()``; library code takes the
dataclasses (or plain arguments), never ``os.environ``.
"""

from __future__ import annotations

import enum
import math
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvwire.errors import ConfigError
from kvwire.protocol.messages import TransferMode

# A transport's name (``--backend``): ``kvwire.transport.registry`` resolves it to the transport and
# refuses an unknown one; ``registry.names()`` lists them.
Backend = NewType("Backend", str)
DEFAULT_BACKEND = Backend("nixl")


ENV_SECRET = "KVWIRE_SECRET"
# A second secret an engine accepts (never signs with): rotating KVWIRE_SECRET over a live fleet in two
# three rolls (docs/configuration.md, "Rotating KVWIRE_SECRET").
ENV_SECRET_ACCEPT = "KVWIRE_SECRET_ACCEPT"
ENV_SIDE_CHANNEL_HOST = "KVWIRE_SIDE_CHANNEL_HOST"
ENV_LOG_LEVEL = "KVWIRE_LOG_LEVEL"
_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class EnvConfig:
    secret: bytes | None = None
    side_channel_host: str | None = None
    log_level: str = "info"
    accept_secret: bytes | None = None  # KVWIRE_SECRET_ACCEPT


def process_environ() -> Mapping[str, str]:
    """The process's environment, for ``kvwire.options.resolve`` (options read it through this)."""
    return os.environ


def env_config(environ: Mapping[str, str] | None = None) -> EnvConfig:
    env = os.environ if environ is None else environ
    secret = env.get(ENV_SECRET) or None
    host = env.get(ENV_SIDE_CHANNEL_HOST) or None
    level = (env.get(ENV_LOG_LEVEL) or "info").lower()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"{ENV_LOG_LEVEL}={level!r}: expected one of {', '.join(_LOG_LEVELS)}")
    accept = env.get(ENV_SECRET_ACCEPT) or None
    if accept and not secret:
        raise ConfigError(
            f"{ENV_SECRET_ACCEPT} is set but {ENV_SECRET} is not: an engine accepts a second secret only "
            f"beside its own (rotation: set {ENV_SECRET} to the secret it signs with)"
        )
    return EnvConfig(
        secret=secret.encode() if secret else None,
        side_channel_host=host,
        log_level=level,
        accept_secret=accept.encode() if accept and accept != secret else None,
    )


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` (a ``#fragment`` is kept)."""
    url, sep, fragment = url.strip().partition("#")
    url = url.rstrip("/")
    if not url:
        raise ConfigError("empty engine URL")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"engine URL {url!r}: only http and https are supported")
    return url + sep + fragment


def split_urls(values: Sequence[str]) -> tuple[str, ...]:
    """Flag values, each possibly comma-separated, as normalized URLs (order kept, duplicates refused)."""
    urls = [normalize_url(part) for value in values for part in value.split(",") if part.strip()]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"an engine URL is listed twice: {urls}")
    return tuple(urls)


class Policy(enum.Enum):
    """How the router picks one P and one D per request (``kvwire.router.policy.Picker`` applies it).

    Defined here, not beside the picker, because ``RouterConfig`` names it and config sits below the
    router: nothing in this module may import ``kvwire.router``."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    # P by prefix-cache overlap against its prefill queue, D by load (``kvwire.router.policy``).
    PREFIX_AWARE = "prefix_aware"


class Disaggregation(enum.Enum):
    """Whether the router sends every request through a P (``always``), or lets D prefill a request itself
    when a remote prefill would not pay (``conditional``: a short prompt, or P's prefill queue longer than
    D's; ``kvwire.router.policy.decide_prefill``), as Dynamo's disaggregated router does."""

    ALWAYS = "always"
    CONDITIONAL = "conditional"


# Prompts of at most this many tokens are prefilled on D under ``conditional``. Measured on the reference
# engine (docs/benchmarks.md, "Conditional disaggregation"): below it a local prefill costs D less time than
# the fixed overhead a disaggregated request adds to its own TTFT (router leg to P, push_reg, notification).
LOCAL_PREFILL_MAX_TOKENS = 192


# What the router's engines are (``--engines``), by name: ``kvwire.router.dialects`` resolves it (kvwire's
# own engines, whose ``/health`` names P's side channel; vLLM servers running KvwireConnector, whose P's
# side channel is in its URL's fragment: ``http://host:8100#engine_id=prefill-0&side_channel=10.0.0.1:5700``).
EngineKind = NewType("EngineKind", str)


# Bind addresses meaning every interface: no peer can dial them, so another address must be advertised.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
_LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", "::", "[::]"})


def _is_own_address(url: str, host: str, port: int) -> bool:
    """Whether an engine URL names the router's own socket (the router would probe and call itself)."""
    parsed = urllib.parse.urlsplit(url.partition("#")[0])
    try:
        url_port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return False
    url_host = (parsed.hostname or "").lower()
    if url_port != port:
        return False
    return url_host == host.lower() or (url_host in _LOCAL_HOSTS and host.lower() in _LOCAL_HOSTS)


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    policy: Policy = Policy.ROUND_ROBIN
    disaggregation: Disaggregation = Disaggregation.ALWAYS
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # only read under CONDITIONAL
    # PUSH: both legs at once. PULL: P's leg first, then D's with P's block ids (D reads them).
    mode: TransferMode = TransferMode.PUSH
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "kvwire"
    # A whole request (both legs); long prompts on a slow CPU engine take seconds.
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    engines: EngineKind = EngineKind("kvwire")
    # The key clients of the router's /v1 API must send (None: none asked), and the key the router sends to
    # the engines (their --api-key). Kept out of repr: configs get logged.
    api_key: str | None = field(default=None, repr=False)
    engine_api_key: str | None = field(default=None, repr=False)
    # Sent on every leg (header x-kvwire-router-token): engines with the same token take kv_transfer_params
    # from the router only.
    router_token: str | None = field(default=None, repr=False)
    # etcd://HOST:PORT[/prefix]: engines found there join the static URLs (``kvwire.discovery``).
    discovery: str | None = None
    # Requests in flight at once; one more is refused 503 at once. Each holds up to two engine connections,
    # and the legs' pool holds exactly twice this many, so a leg never waits for a connection another
    # request holds (a shared pool of 512 starved push-mode pairs and the health polls past 512 streams).
    max_requests: int = 2048

    def __post_init__(self) -> None:
        if (not self.prefill_urls or not self.decode_urls) and self.discovery is None:
            raise ConfigError(
                "the router needs at least one prefill and one decode engine URL (or --discovery)"
            )
        if set(self.prefill_urls) & set(self.decode_urls):
            raise ConfigError("an engine cannot be both a prefill and a decode engine of one router")
        for url in (*self.prefill_urls, *self.decode_urls):
            if _is_own_address(url, self.host, self.port):
                raise ConfigError(
                    f"engine URL {url} is this router's own address ({self.host}:{self.port}): "
                    "list the engines' URLs, or give the router another --port"
                )
        if self.max_requests < 1:
            raise ConfigError(f"--max-requests {self.max_requests}: at least 1")
        for name in ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):  # NaN passed ``<= 0``: every request then a 500
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError("local_prefill_max_tokens must be at least 0")
