"""vLLM servers running KvwireConnector: identity from the URL's fragment or the discovery record, health from
``/health`` (200) and the served model from ``/v1/models``."""

from __future__ import annotations

import dataclasses
import ipaddress
import urllib.parse

from kvwire.config import WILDCARD_HOSTS
from kvwire.errors import ConfigError
from kvwire.router.dialects.base import Dialect
from kvwire.router.health import HealthInfo, split_fragment
from kvwire.router.http import EngineClient, json_object
from kvwire.router.policy import Load, Role


class VllmDialect(Dialect):
    name = "vllm"
    summary = (
        "vLLM servers running KvwireConnector (then each --prefill URL ends with "
        "#engine_id=ID&side_channel=HOST:PORT[&tp=N&pp=N], its kv_connector_extra_config's values)"
    )
    bytes_per_token = 4.0  # vLLM's tokenizers, which the router does not load: a rough average for English
    identity_from_records = True
    openai_server = True

    def static_info(self, url: str, role: Role) -> HealthInfo | None:
        return _static_info(url, role)

    async def fetch(
        self, client: EngineClient, url: str, static: HealthInfo | None, timeout_s: float
    ) -> HealthInfo:
        status, _body = await client.get(f"{url}/health", timeout_s)
        if status != 200:
            raise ValueError(f"/health answered {status}")
        if static is None:
            raise ValueError("no identity: give it in the URL's fragment or through discovery")
        # Healthy when /health is 200; its served model names come from /v1/models.
        status, body = await client.get(f"{url}/v1/models", timeout_s, api_key=True)
        if status != 200:
            raise ValueError(f"/v1/models answered {status}")
        names = [str(m["id"]) for m in json_object(body).get("data", [])]
        return dataclasses.replace(static, model=names[0] if names else "")


def _static_info(url: str, role: Role) -> HealthInfo:
    """A vLLM engine's identity from its URL's fragment (vLLM's ``/health`` says nothing of kvwire):
    ``engine_id``, ``side_channel=HOST:PORT``, ``tp``, ``pp``. A decode engine needs none of them."""
    base, fragment = split_fragment(url)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(fragment).items()}
    host, port = "", 0
    if role is Role.PREFILL:
        if "engine_id" not in q or "side_channel" not in q:
            raise ConfigError(
                f"prefill engine {base}: a vLLM prefill URL ends with #engine_id=ID&side_channel=HOST:PORT "
                "(the engine_id of its --kv-transfer-config and its side_channel_host/side_channel_port)"
            )
        host, _, raw_port = q["side_channel"].rpartition(":")
        if not host or not raw_port.isdigit():
            raise ConfigError(f"prefill engine {base}: side_channel={q['side_channel']!r} is not HOST:PORT")
        port = int(raw_port)
    try:
        tp, pp = int(q.get("tp", 1)), int(q.get("pp", 1))
    except ValueError:
        raise ConfigError(f"engine {base}: tp and pp in the URL must be integers") from None
    hosts = tuple(q["side_channel_hosts"].split(",")) if "side_channel_hosts" in q else ()
    if hosts and (len(hosts) != tp * pp or not all(_dialable(h) for h in hosts)):
        raise ConfigError(
            f"engine {base}: side_channel_hosts={q['side_channel_hosts']!r} must name one host per rank "
            f"({tp * pp} for tp {tp} pp {pp}), comma-separated, rank (pp, tp) at pp * tp_size + tp; each a "
            "name or address D dials (no port, no 0.0.0.0)"
        )
    info = HealthInfo(role.value, q.get("engine_id", base), "", host, port, tp, pp, "", Load())
    return dataclasses.replace(info, side_channel_hosts=hosts) if any(h != host for h in hosts) else info


def _dialable(host: str) -> bool:
    """A host D can dial: not empty, no space, not a wildcard, no port (a ':' only in an IPv6 address)."""
    if host in WILDCARD_HOSTS or host != host.strip() or " " in host:
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
    return True


DIALECT = VllmDialect()
