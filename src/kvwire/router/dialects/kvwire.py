"""kvwire's own engines: their ``/health`` says everything, including P's side channel."""

from __future__ import annotations

from kvwire.errors import ConfigError
from kvwire.router.dialects.base import Dialect
from kvwire.router.health import HealthInfo, split_fragment
from kvwire.router.http import EngineClient, json_object
from kvwire.router.policy import Role


class KvwireDialect(Dialect):
    name = "kvwire"
    summary = "kvwire engines (their /health names P's side channel)"
    bytes_per_token = 1.0  # exact: the reference engines' tokens are bytes

    def static_info(self, url: str, role: Role) -> HealthInfo | None:
        if split_fragment(url)[1]:
            raise ConfigError(f"engine URL {url}: a #fragment is only for --engines vllm")
        return None

    async def fetch(
        self, client: EngineClient, url: str, static: HealthInfo | None, timeout_s: float
    ) -> HealthInfo:
        status, body = await client.get(f"{url}/health", timeout_s)
        if status != 200:
            raise ValueError(f"/health answered {status}")
        return HealthInfo.parse(json_object(body))


DIALECT = KvwireDialect()
