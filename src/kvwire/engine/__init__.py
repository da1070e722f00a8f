"""The reference engine: a small numpy transformer over a paged KV cache, with continuous batching and
hooks for a KV connector. ``kvwire.engine.server`` serves it over HTTP."""

from kvwire.engine.config import PRESETS, EngineConfig, ModelConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.hooks import HookEvents, KVTransferHooks, TransferRequest
from kvwire.engine.request import FinishReason, Request, RequestOutput, RequestState, TransferRole
from kvwire.engine.tokenizer import ByteTokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "HookEvents",
    "KVTransferHooks",
    "ModelConfig",
    "Request",
    "RequestOutput",
    "RequestState",
    "Role",
    "TransferRequest",
    "TransferRole",
    "preset",
]
