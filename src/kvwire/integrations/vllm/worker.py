"""The worker side of the vLLM connector, without vLLM: one per worker process (one TP/PP rank).

``register`` wraps vLLM's KV tensors (zero copy), creates this rank's NIXL agent and a kvwire
``Producer`` (P) and/or ``Consumer`` (D) serving this rank alone on its own side-channel port. ``apply``
turns the scheduler's operations into connector calls; ``finished`` turns connector events into vLLM's
``finished_sending`` / ``finished_recving`` / ``failed_recving`` (see ``scheduler.py`` for the rules).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.config import env_config
from kvwire.connector import (
    Consumer,
    ConsumerEvent,
    ConsumerEventKind,
    Producer,
    ProducerEvent,
    ProducerOutcome,
)
from kvwire.errors import KvwireError, TransferIdReused
from kvwire.handshake.types import EngineInfo
from kvwire.integrations.api import (
    ConnectorT,
    Endpoint,
    close_all,
    open_ranks,
    remote_engine,
    start_connector,
)
from kvwire.integrations.vllm.layerwise import LayerStreamer
from kvwire.integrations.vllm.memory import kv_from_vllm
from kvwire.integrations.vllm.params import KvRole, Op, OpKind, RankChannel, Settings, rank_host
from kvwire.integrations.vllm.stats import StepStats
from kvwire.kv.regions import ExternalKV
from kvwire.transport.base import Agent

log = logging.getLogger("kvwire.vllm")


@dataclass(frozen=True, slots=True)
class RankPlace:
    """This worker's identity and the model's KV geometry (from vLLM's config)."""

    engine_id: str
    incarnation: str
    model_id: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    num_layers: int  # the model's total
    kv_heads: int  # the model's total
    head_dim: int
    block_size: int
    mla: bool = False
    kv_tiles: bool = False  # vLLM's CPU backend: a fused head block is a K tile then a V tile
    layer_groups: tuple[int, ...] = ()  # a hybrid model's KV cache groups (integrations/vllm/hma.py)
    group_windows: tuple[int, ...] = ()


@dataclass(slots=True)
class Finished:
    """One step's report to vLLM."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class WorkerSide:
    def __init__(self, role: KvRole, settings: Settings, place: RankPlace) -> None:
        self.role = role
        self.settings = settings
        self.place = place
        # This node's address: KVWIRE_SIDE_CHANNEL_HOST on a multi-node engine.
        self.host = rank_host(settings)
        self.kv: ExternalKV | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.streamer: LayerStreamer | None = None  # layerwise push (P)
        self._agents: list[Agent] = []
        self._sends: dict[str, str] = {}  # P: transfer_id -> vLLM request id, until kvwire's event
        self._loads: dict[str, str] = {}  # D: transfer_id -> vLLM request id, until READY or RELEASED
        self._failed: set[str] = set()  # D: transfer ids that FAILED and are not RELEASED yet
        self._done = Finished()
        self._news = threading.Event()  # set by kvwire's loop thread on every event
        self._stats = StepStats()

    # -- start-up --------------------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any]) -> None:
        p = self.place
        self.kv = kv_from_vllm(
            kv_caches,
            num_layers=p.num_layers,
            kv_heads=p.kv_heads,
            head_dim=p.head_dim,
            block_size=p.block_size,
            tp_size=p.tp_size,
            tp_rank=p.tp_rank,
            mla=p.mla,
            kv_tiles=p.kv_tiles,
            layer_groups=p.layer_groups,
            group_windows=p.group_windows,
        )
        log.info(
            "kvwire: rank pp%d/tp%d registers %d regions (%s, %d blocks of %d B, %s)",
            p.pp_rank, p.tp_rank, len(self.kv.regions()), self.kv.spec.layout.value, self.kv.num_blocks,
            self.kv.block_len, self.kv.mem_kind.value,
        )  # fmt: skip
        try:
            if self.role.produces:
                self.producer = self._start(Producer, 0)
                if self.settings.layerwise:
                    self.streamer = LayerStreamer(self.producer, self.settings.transfer_timeout_s)
            if self.role.consumes:
                # kv_both: the consumer's side channel sits after every producer rank's.
                offset = p.tp_size * p.pp_size if self.role.produces else 0
                self.consumer = self._start(Consumer, offset)
        except BaseException:
            self.close()
            raise

    def _start(self, cls: type[ConnectorT], offset: int) -> ConnectorT:
        p, s, kv = self.place, self.settings, self.kv
        assert kv is not None
        # Producer and consumer of one kv_both engine are two engines to their peers: distinct ids.
        engine_id = p.engine_id if cls is Producer or self.role is not KvRole.BOTH else f"{p.engine_id}-d"
        info = EngineInfo(engine_id, p.incarnation, p.model_id, kv.spec, p.tp_size, p.pp_size, s.mode)
        agents, ranks = open_ranks(
            s.backend,
            engine_id,
            p.incarnation,
            [((p.pp_rank, p.tp_rank), kv)],
            s.handshake_timeout_s,
            advertise_host=self.host,
        )
        self._agents += agents
        port = s.rank_port(p.pp_rank, p.tp_rank, p.tp_size) + offset
        env = env_config()
        at = Endpoint(self.host, port, None, env.secret, env.accept_secret)
        return start_connector(cls, info, ranks, s.connector_config(), at, on_event=self._news.set)

    def channel(self) -> RankChannel | None:
        """Where this rank's (producer's) side channel listens, when its node set its own address
        (``KVWIRE_SIDE_CHANNEL_HOST``): vLLM's handshake metadata, which the scheduler gathers from every
        worker (``SchedulerSide.set_channels``). None otherwise: the rank is at ``side_channel_host``, and
        vLLM's MultiConnector, which hands one sub-connector's metadata to all of them, is left alone."""
        if self.host == self.settings.side_channel_host:
            return None
        p = self.place
        return RankChannel(self.host, self.settings.rank_port(p.pp_rank, p.tp_rank, p.tp_size))

    # -- per step --------------------------------------------------------------------------------------
    def bind(self, ops: Iterable[Op]) -> None:
        """vLLM's ``bind_connector_metadata``, before the step's forward: its STREAM ops, whose layers the
        forward's ``save_kv_layer`` calls hand over (``start_load_kv`` comes too late for them)."""
        self.apply(op for op in ops if op.kind is OpKind.STREAM)

    def start(self, ops: Iterable[Op]) -> None:
        """vLLM's ``start_load_kv``: the step's other ops. vLLM 0.32 (CPU) and 0.34 call it after the
        forward unless a load of the step is synchronous, which kvwire's never are."""
        self.apply(op for op in ops if op.kind is not OpKind.STREAM)

    def apply(self, ops: Iterable[Op]) -> None:
        for op in ops:
            try:
                self._apply(op)
            except KvwireError as exc:
                # Bad local input: nothing was registered with a peer, so the blocks are vLLM's at once.
                log.warning("kvwire: %s %s refused: %s", op.kind.value, op.req_id, exc)
                if op.kind is OpKind.SEND:
                    if self._sends.get(op.transfer_id) == op.req_id:  # not another request's, same id
                        del self._sends[op.transfer_id]
                    self._done.sending.add(op.req_id)
                elif op.kind is OpKind.LOAD:
                    if self._loads.get(op.transfer_id) == op.req_id:  # not another request's, same id
                        del self._loads[op.transfer_id]
                    self._done.recving.add(op.req_id)
                    self._done.failed_recving.add(op.req_id)

    def _apply(self, op: Op) -> None:
        log.debug("kvwire: %s %s transfer_id=%s blocks=%d tokens=%d cached=%d", op.kind.value, op.req_id,
                  op.transfer_id, len(op.block_ids), op.num_tokens, op.num_cached_tokens)  # fmt: skip
        if op.kind is OpKind.SEND and self.producer is not None:
            if op.transfer_id in self._sends:  # a held request's id (a client's retry): kvwire refuses it too
                raise TransferIdReused(op.transfer_id)
            self._sends[op.transfer_id] = op.req_id
            self.producer.request_finished(op.transfer_id, op.block_ids, op.num_tokens)
        elif op.kind is OpKind.LOAD and self.consumer is not None and op.remote is not None:
            remote = remote_engine(op.remote, rank_ports=True)  # one process, one side channel per rank
            if op.transfer_id in self._loads:  # a live request's id: the connector would refuse it too
                raise TransferIdReused(op.transfer_id)
            self._loads[op.transfer_id] = op.req_id
            self.consumer.request_allocated(
                op.transfer_id, op.block_ids, op.num_tokens, op.num_cached_tokens, remote
            )
        elif op.kind is OpKind.STREAM and self.streamer is not None:
            self.streamer.stream(op)
        elif op.kind is OpKind.DROP and self.producer is not None:
            if self._sends.get(op.transfer_id, op.req_id) != op.req_id:
                return  # the id is another (held) request's: this one never reached kvwire
            self.producer.abort(op.transfer_id)  # no event follows: the engine already owns the blocks
        elif op.kind is OpKind.DECLINE and self.consumer is not None and op.remote is not None:
            self.consumer.decline(op.transfer_id, remote_engine(op.remote, rank_ports=True))
        elif op.kind is OpKind.ABORT and self.consumer is not None:
            tid = next((t for t, r in self._loads.items() if r == op.req_id), None)
            if tid is not None:
                self.consumer.abort(tid)  # reported when kvwire says RELEASED (or READY, if first)

    def finished(self, wait_s: float = 0.0) -> Finished:
        """What ended since the last call (each request reported once). With ``wait_s`` and transfers
        live but nothing new, first wait that long for kvwire's next event (an idle engine step)."""
        if wait_s > 0 and (self._sends or self._loads) and not self._done.sending and not self._done.recving:
            self._news.wait(wait_s)
        self._news.clear()
        if self.producer is not None:
            for pe in self.producer.poll():
                self._on_producer(pe)
        if self.consumer is not None:
            for ce in self.consumer.poll():
                self._on_consumer(ce)
        out, self._done = self._done, Finished()
        return out

    def _on_producer(self, e: ProducerEvent) -> None:
        log.debug("kvwire: transfer_id=%s P %s", e.transfer_id, e.outcome.value)
        req = self._sends.pop(e.transfer_id, None)
        if req is None:
            return
        if e.outcome not in (ProducerOutcome.SENT, ProducerOutcome.PULLED):
            log.info("kvwire: P's hold on %s ended %s", req, e.outcome.value)
        self._done.sending.add(req)

    def _on_consumer(self, e: ConsumerEvent) -> None:
        log.debug(
            "kvwire: transfer_id=%s D %s %s", e.transfer_id, e.kind.value, e.reason.value if e.reason else ""
        )
        if e.kind is ConsumerEventKind.FAILED:
            self._failed.add(e.transfer_id)
            return
        req = self._loads.pop(e.transfer_id, None)
        if req is None:
            return
        self._done.recving.add(req)
        failed = e.transfer_id in self._failed
        self._failed.discard(e.transfer_id)
        if e.kind is ConsumerEventKind.RELEASED and failed:
            log.info("kvwire: KV for %s failed (%s); blocks released", req, e.reason)
            self._done.failed_recving.add(req)

    def step_stats(self) -> dict[str, Any] | None:
        """What this rank's connectors did since the last call (``stats``' payload), or None."""
        return self._stats.take(c for c in (self.producer, self.consumer) if c is not None)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        close_all((self.producer, self.consumer), self._agents)
        self._agents.clear()
