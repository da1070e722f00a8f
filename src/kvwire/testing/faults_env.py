"""P and D connectors on one in-process fabric and one loop, for the fault suite (P can be restarted)."""

from __future__ import annotations

import itertools
from typing import TypeVar

import numpy as np

from kvwire.connector import ConnectorConfig, Consumer, ConsumerEvent, Producer, ProducerEvent, RemoteEngine
from kvwire.handshake.loop import BackgroundLoop
from kvwire.kv.cache import KVCache
from kvwire.kv.spec import KVSpec
from kvwire.testing.engines import EngineSetup, build_engine, wait_for
from kvwire.testing.procs import free_port
from kvwire.transport.inproc import InprocAgent, InprocFabric

T = TypeVar("T")
WAIT_S = 10.0
_ids = itertools.count()


def block_bytes(cache: KVCache) -> np.ndarray:
    """The slab as bytes, ``[layers, kinds, blocks, ...]``: index ``[:, :, ids]`` for blocks' bytes."""
    return cache.slab.view(np.uint8)


class Cluster:
    """One P engine and one D engine (one rank each by default) sharing an in-process fabric and loop."""

    def __init__(
        self,
        spec: KVSpec,
        config: ConnectorConfig,
        *,
        d_config: ConnectorConfig | None = None,
        num_blocks: int = 32,
        p_tp: int = 1,
        d_tp: int = 1,
    ) -> None:
        n = next(_ids)
        self.spec = spec
        self.config = config
        self.num_blocks = num_blocks
        self.p_tp = p_tp
        self.fabric = InprocFabric()
        self.loop = BackgroundLoop(name="kvwire-faults")
        self.p_id = f"p{n}"
        self.d: EngineSetup = build_engine(f"d{n}", spec, tp=d_tp, num_blocks=num_blocks, fabric=self.fabric)
        self.consumer = Consumer(self.d.engine, self.d.ranks, d_config or config, loop=self.loop)
        self.consumer.start()
        self.p_port = free_port()  # below the ephemeral range: restarts rebind it (see testing.procs)
        self.p: EngineSetup
        self.producer: Producer
        self._old: list[tuple[Producer, EngineSetup]] = []
        self.start_p()
        self.p_events: list[ProducerEvent] = []
        self.d_events: list[ConsumerEvent] = []

    def start_p(self) -> None:
        """Start P (again): same engine id and side-channel port, a new incarnation and new agents."""
        self.p = build_engine(
            self.p_id, self.spec, tp=self.p_tp, num_blocks=self.num_blocks, fabric=self.fabric
        )
        self.producer = Producer(self.p.engine, self.p.ranks, self.config, port=self.p_port, loop=self.loop)
        self.p_port = self.producer.start()

    def kill_p(self) -> None:
        """P dies: its agents vanish from the fabric (what they had posted never completes), its side
        channel closes. Nothing is said to D."""
        for rank in self.p.ranks:
            self.fabric.kill(rank.agent.name)
        self.loop.run(self._stop_server(self.producer), 10.0)
        self._old.append((self.producer, self.p))

    @staticmethod
    async def _stop_ticker(connector: Producer | Consumer) -> None:
        if connector._ticker is not None:
            connector._ticker.cancel()

    @classmethod
    async def _stop_server(cls, connector: Producer | Consumer) -> None:
        # Only the side channel and the ticker: a killed process sends no goodbye.
        await cls._stop_ticker(connector)
        if connector._server is not None:
            await connector._server.close()

    def p_agent(self, i: int = 0) -> InprocAgent:
        agent = self.p.ranks[i].agent
        assert isinstance(agent, InprocAgent)
        return agent

    def d_agent(self, i: int = 0) -> InprocAgent:
        agent = self.d.ranks[i].agent
        assert isinstance(agent, InprocAgent)
        return agent

    def remote(self) -> RemoteEngine:
        e = self.p.engine
        return RemoteEngine(e.engine_id, "127.0.0.1", self.p_port, e.tp_size, e.pp_size)

    def pump(self) -> None:
        self.p_events += self.producer.poll()
        self.d_events += self.consumer.poll()

    def p_event(self, transfer_id: str, timeout_s: float = WAIT_S) -> ProducerEvent:
        def find() -> ProducerEvent | None:
            self.pump()
            return next((e for e in self.p_events if e.transfer_id == transfer_id), None)

        return wait_for(find, f"producer event for {transfer_id}", timeout_s)

    def d_final(self, transfer_id: str, timeout_s: float = WAIT_S) -> list[ConsumerEvent]:
        """A request's events on D, once its final one (READY or RELEASED) came."""

        def find() -> list[ConsumerEvent] | None:
            self.pump()
            mine = [e for e in self.d_events if e.transfer_id == transfer_id]
            return mine if any(e.kind.value in ("ready", "released") for e in mine) else None

        return wait_for(find, f"final consumer event for {transfer_id}", timeout_s)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        for producer, _setup in self._old:
            producer.close()
        self.loop.close()
        self.p.close()
        self.d.close()
        for _producer, setup in self._old:
            setup.close()
