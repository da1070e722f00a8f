"""A process hosting one connector engine at a time, driven over a pipe (integration tests).

``ConnectorWorker`` starts a ``spawn`` child that runs ``serve``; each ``call(cmd, **kw)`` is one command
and its answer. The child builds engines on the real NIXL backend (by default), so P and D live in
separate processes and talk only through NIXL and the side channel, as in production.
"""

from __future__ import annotations

import multiprocessing.connection
import time
from typing import Any

import numpy as np

from kvwire.connector import (
    ConnectorConfig,
    Consumer,
    ConsumerEvent,
    ConsumerEventKind,
    Producer,
    ProducerEvent,
    RemoteEngine,
)
from kvwire.errors import KvwireError
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import TransferMode
from kvwire.testing.child import CommandChild, serve_commands
from kvwire.testing.engines import EngineSetup, build_engine, gather_tokens, random_kv, scatter_tokens
from kvwire.testing.engines import untouched_blocks_zero as _untouched
from kvwire.transport.base import Desc, XferOp, as_full

_CALL_TIMEOUT_S = 60.0


class _Host:
    """The child's state: at most one engine and its connector."""

    def __init__(self) -> None:
        self.setup: EngineSetup | None = None
        self.conn: Producer | Consumer | None = None
        self.events: list[ProducerEvent | ConsumerEvent] = []

    def engine(
        self,
        role: str,
        engine_id: str,
        spec: dict[str, Any],
        tp: int,
        pp: int,
        num_blocks: int,
        mode: str,
        backend: str = "nixl",
        secret: bytes | None = None,
        accept_secret: bytes | None = None,
    ) -> dict[str, Any]:
        self.close_engine()
        kv = KVSpec(**spec)
        tmode = TransferMode(mode)
        self.setup = build_engine(
            engine_id, kv, tp=tp, pp=pp, num_blocks=num_blocks, mode=tmode, backend=backend
        )
        cfg = ConnectorConfig(mode=tmode)
        cls = Producer if role == "p" else Consumer
        self.conn = cls(self.setup.engine, self.setup.ranks, cfg, secret=secret, accept_secret=accept_secret)
        port = self.conn.start()
        return {"port": port, "engine_id": engine_id, "agents": [r.agent.name for r in self.setup.ranks]}

    def _setup(self) -> EngineSetup:
        assert self.setup is not None
        return self.setup

    def fill(
        self, block_ids: list[int], num_tokens: int, seed: int, tokens: tuple[int, int] | None = None
    ) -> None:
        kv = random_kv(self._setup().engine.spec, num_tokens, seed)
        scatter_tokens(self._setup().ranks, block_ids, kv, None if tokens is None else range(*tokens))

    def finish(self, tid: str, block_ids: list[int], num_tokens: int) -> None:
        assert isinstance(self.conn, Producer)
        self.conn.request_finished(tid, block_ids, num_tokens)

    def allocate(
        self, tid: str, block_ids: list[int], num_tokens: int, cached: int, remote: dict[str, Any]
    ) -> None:
        assert isinstance(self.conn, Consumer)
        remote["block_ids"] = tuple(remote.get("block_ids", ()))
        self.conn.request_allocated(tid, block_ids, num_tokens, cached, RemoteEngine(**remote))

    def wait(self, tid: str, timeout_s: float = 20.0) -> list[str]:
        """The request's events, once its final one came (P: its one event; D: READY or RELEASED)."""
        assert self.conn is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.events += self.conn.poll()
            mine = [e for e in self.events if e.transfer_id == tid]
            names = [_describe(e) for e in mine]
            if isinstance(self.conn, Producer) and mine:
                return names
            if any(isinstance(e, ConsumerEvent) and e.kind is not ConsumerEventKind.FAILED for e in mine):
                return names
            time.sleep(0.001)
        raise TimeoutError(f"no final event for {tid} within {timeout_s} s")

    def gather(self, block_ids: list[int], start: int, stop: int) -> np.ndarray:
        return gather_tokens(self._setup().ranks, block_ids, range(start, stop))

    def untouched(self, used: list[int]) -> bool:
        return _untouched(self._setup().ranks, used)

    def peer_modes(self) -> dict[str, dict[str, str | None]]:
        """For each local agent: how every agent name the handshake managers know is loaded."""
        assert self.conn is not None
        out: dict[str, dict[str, str | None]] = {}
        for key, rank in self.conn.ranks.items():
            names = [p.agent_name for p in self.conn.managers[key].peers()]
            modes = {n: (None if (m := as_full(rank.agent).peer_mode(n)) is None else m.value) for n in names}
            out[rank.agent.name] = modes
        return out

    def regions(self) -> list[tuple[int, int]]:
        """(base address, length of one block) of each region of rank 0."""
        return [(r.base_addr, r.block_len) for r in self._setup().ranks[0].cache.regions()]

    def try_read(self, peer: str, addr: int, length: int) -> str:
        """Post a READ of a peer's memory into our rank 0's first block; the typed error's name, or 'ok'."""
        rank = self._setup().ranks[0]
        local = rank.cache.regions()[0]
        try:
            handle = as_full(rank.agent).post(
                XferOp.READ, [Desc(local.base_addr, length)], [Desc(addr, length)], peer
            )
        except KvwireError as exc:
            return type(exc).__name__
        rank.agent.release(handle)
        return "ok"

    def stats(self) -> dict[str, Any]:
        assert self.conn is not None
        s = self.conn.stats
        return {
            "transfers_done": s.transfers_done,
            "bytes": s.bytes_moved,
            "descs": s.descriptors_posted,
            "durations": list(s.transfer_durations_s),
            "dropped": dict(s.dropped_notifs),
        }

    def close_engine(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.setup is not None:
            self.setup.close()
        self.conn, self.setup, self.events = None, None, []


def _describe(e: ProducerEvent | ConsumerEvent) -> str:
    if isinstance(e, ProducerEvent):
        return e.outcome.value
    return e.kind.value if e.reason is None else f"{e.kind.value}:{e.reason.value}"


def serve(conn: multiprocessing.connection.Connection) -> None:
    host = _Host()
    serve_commands(conn, host, host.close_engine)


class ConnectorWorker(CommandChild):
    """The parent's handle on one worker process."""

    def __init__(self) -> None:
        super().__init__(serve, _CALL_TIMEOUT_S)
