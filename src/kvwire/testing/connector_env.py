"""A P engine and a D engine on one in-process fabric, sharing one background loop (tests only)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from kvwire.connector import (
    ConnectorConfig,
    Consumer,
    ConsumerEvent,
    Producer,
    ProducerEvent,
    RemoteEngine,
)
from kvwire.handshake.loop import BackgroundLoop
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import TransferMode
from kvwire.testing.engines import (
    EngineSetup,
    build_engine,
    gather_tokens,
    random_kv,
    scatter_tokens,
    wait_for,
)
from kvwire.transport.inproc import InprocAgent, InprocFabric

T = TypeVar("T")
WAIT_S = 10.0
_ids = itertools.count()


class Pair:
    def __init__(
        self,
        spec: KVSpec,
        *,
        p_tp: int = 1,
        p_pp: int = 1,
        d_tp: int = 1,
        mode: TransferMode = TransferMode.PUSH,
        config: ConnectorConfig | None = None,
        d_config: ConnectorConfig | None = None,
        num_blocks: int = 32,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        n = next(_ids)
        # Both connectors' one clock (a ``VirtualClock`` lets a test fire timers without sleeping).
        self.clock = clock
        self.spec = spec
        self.num_blocks = num_blocks
        self.mode = mode
        self.secret = secret
        self.p_tp, self.p_pp, self.d_tp = p_tp, p_pp, d_tp
        self.fabric = InprocFabric()
        # One loop for both sides: the in-process agents are then only touched from one thread.
        self.loop = BackgroundLoop(name="kvwire-test")
        # Tests check every request's bytes against P's digest (production samples, or not at all).
        cfg = self.p_config = config or ConnectorConfig(mode=mode, kv_digest_sample=1.0)
        self.d_config = d_config or cfg
        self.p: EngineSetup = build_engine(
            f"p{n}", spec, tp=p_tp, pp=p_pp, num_blocks=num_blocks, mode=mode, fabric=self.fabric
        )
        self.d: EngineSetup = build_engine(
            f"d{n}", spec, tp=d_tp, num_blocks=num_blocks, mode=mode, fabric=self.fabric
        )
        self.producer = Producer(self.p.engine, self.p.ranks, cfg, loop=self.loop, secret=secret, clock=clock)
        self.consumer = Consumer(
            self.d.engine, self.d.ranks, self.d_config, loop=self.loop, secret=secret, clock=clock
        )
        self.p_port = self.producer.start()
        self.consumer.start()
        self.p_events: list[ProducerEvent] = []
        self.d_events: list[ConsumerEvent] = []

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the connectors' loop thread (the in-process agents are not thread-safe)."""

        async def call() -> T:
            return fn()

        return self.loop.run(call(), WAIT_S)

    def restart_p(self, *, kill: bool) -> None:
        """P's process ends (killed, or closed cleanly) and a new life of the same engine starts at the
        same side-channel address; D keeps running."""
        if kill:
            for rank in self.p.ranks:
                self.fabric.kill(rank.agent.name)
        self.producer.close()
        self.p.close()
        eid = self.p.engine.engine_id
        self.p = build_engine(
            eid, self.spec, tp=self.p_tp, pp=self.p_pp, num_blocks=self.num_blocks, mode=self.mode,
            fabric=self.fabric,
        )  # fmt: skip
        self.producer = Producer(
            self.p.engine,
            self.p.ranks,
            self.p_config,
            port=self.p_port,
            loop=self.loop,
            secret=self.secret,
            clock=self.clock,
        )
        assert self.producer.start() == self.p_port

    def restart_d(self) -> None:
        """D closes and a new life of the same engine starts at the same address; P keeps running."""
        port = self.consumer.port
        self.consumer.close()
        self.d.close()
        self.d = build_engine(
            self.d.engine.engine_id, self.spec, tp=self.d_tp, num_blocks=self.num_blocks, mode=self.mode,
            fabric=self.fabric,
        )  # fmt: skip
        self.consumer = Consumer(
            self.d.engine,
            self.d.ranks,
            self.d_config,
            port=port,
            loop=self.loop,
            secret=self.secret,
            clock=self.clock,
        )
        assert self.consumer.start() == port

    def p_agent(self, i: int = 0) -> InprocAgent:
        agent = self.p.ranks[i].agent
        assert isinstance(agent, InprocAgent)
        return agent

    def remote(self, block_ids: tuple[int, ...] = ()) -> RemoteEngine:
        e = self.p.engine
        return RemoteEngine(e.engine_id, "127.0.0.1", self.p_port, e.tp_size, e.pp_size, block_ids)

    def fill_p(self, block_ids: list[int], num_tokens: int, seed: int = 1) -> np.ndarray:
        kv = random_kv(self.spec, num_tokens, seed)
        scatter_tokens(self.p.ranks, block_ids, kv)
        return kv

    def d_tokens(self, block_ids: list[int], tokens: range) -> np.ndarray:
        return gather_tokens(self.d.ranks, block_ids, tokens)

    def p_event(self, transfer_id: str) -> ProducerEvent:
        def find() -> ProducerEvent | None:
            self.p_events += self.producer.poll()
            return next((e for e in self.p_events if e.transfer_id == transfer_id), None)

        return wait_for(find, f"producer event for {transfer_id}")

    def d_event(self, transfer_id: str, *, final: bool = True) -> list[ConsumerEvent]:
        """Events of one request, waiting for its final one (READY or RELEASED) or, if not final, any."""

        def find() -> list[ConsumerEvent] | None:
            self.d_events += self.consumer.poll()
            mine = [e for e in self.d_events if e.transfer_id == transfer_id]
            if not final:
                return mine or None
            return mine if any(e.kind.value in ("ready", "released") for e in mine) else None

        return wait_for(find, f"consumer events for {transfer_id}")

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()
        self.loop.close()
        self.p.close()
        self.d.close()
