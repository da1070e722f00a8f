"""The engine server under test, for test_engine_server*.py: a tiny model's server and what colocated
generation gives (the answer a disaggregated or streamed one must equal)."""

from __future__ import annotations

from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.model import Model
from kvwire.engine.server import EngineServer, Identity

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)


def make_server(role: Role = Role.COLOCATED, num_blocks: int = 128) -> EngineServer:
    engine = Engine(EngineConfig(TINY, role=role, num_blocks=num_blocks), model=MODEL)
    return EngineServer(engine, Identity(role, f"{role.value}-test", "inc0", "127.0.0.1", 5600))


def reference(prompt: str, max_tokens: int) -> list[int]:
    engine = Engine(EngineConfig(TINY, num_blocks=128), model=MODEL)
    return engine.generate([engine.tokenizer.encode(prompt)], max_tokens, ignore_eos=True)[0]
