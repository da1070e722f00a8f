"""kvwire as a vLLM KV connector: ``kv_connector_module_path="kvwire.integrations.vllm"``,
``kv_connector="KvwireConnector"``. Importing this package imports vLLM; the scheduler and worker logic
(``scheduler``, ``worker``, ``params``, ``memory``) does not."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # vLLM is imported only when its connector class is asked for: the pure modules of this package
    # (scheduler, worker, memory, params) stay importable and testable without vLLM.
    if name in ("KvwireConnector", "KvwireMetadata"):
        from kvwire.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)


__all__ = ["KvwireConnector", "KvwireMetadata"]
