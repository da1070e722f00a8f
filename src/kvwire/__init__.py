"""kvwire: move the KV cache of LLM requests from prefill to decode engines over NIXL."""

__version__ = "0.1.0"
