"""One engine kind as the router sees it: how it learns an engine's identity and health, and how it sizes
a text prompt in tokens without the engine's tokenizer."""

from __future__ import annotations

import abc

from kvwire.router.health import HealthInfo
from kvwire.router.http import EngineClient
from kvwire.router.policy import Role


class Dialect(abc.ABC):
    name: str
    # ``--engines``'s help for this kind, one line.
    summary: str
    # UTF-8 bytes per prompt token, to size a text prompt (conditional routing, the prefix index).
    bytes_per_token: float
    # Whether a discovery record says the engine's identity better than anything its /health says: then
    # every poll keeps the record's identity (vLLM's /health says nothing of kvwire).
    identity_from_records: bool = False
    # Whether the engines are full OpenAI servers: then a chat request goes to their /v1/chat/completions
    # with the client's messages (each applies its model's own chat template; the router's fixed template
    # fits only kvwire's reference engines), and a streamed leg asks for its usage chunk with
    # ``stream_options`` (vLLM sends it only when asked; kvwire's engines always put it in their last chunk).
    openai_server: bool = False

    @abc.abstractmethod
    def static_info(self, url: str, role: Role) -> HealthInfo | None:
        """The engine's identity from its configured URL (fragment included), or None when its health
        check says it; ``ConfigError`` on a URL this kind cannot take."""

    @abc.abstractmethod
    async def fetch(
        self, client: EngineClient, url: str, static: HealthInfo | None, timeout_s: float
    ) -> HealthInfo:
        """Check the engine at ``url`` (no fragment) and say what it is now; ``static`` is what
        ``static_info`` or its discovery record gave. Raises ``ValueError``, ``KeyError``, ``TypeError``
        or an ``aiohttp`` error when it is not healthy."""
