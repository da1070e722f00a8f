"""The real connector (``kvwire.connector`` Producer / Consumer) behind the engine's hooks.

``attach_connector`` builds one agent per (pp, tp) rank of the engine's cache, the Producer (prefill
role) or the Consumer (decode role), starts it (its side channel binds then) and plugs it into the engine.
``ConnectorMetrics`` copies the connector's counters into the server's ``KvMetrics`` (on each scrape).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvwire.connector import ConnectorConfig, Consumer, Producer
from kvwire.connector.totals import Deltas, guard_totals, posts_transfers
from kvwire.engine.config import Role
from kvwire.engine.engine import Engine
from kvwire.engine.hooks import HookEvents, TransferRequest
from kvwire.errors import ConfigError, InvalidRequest, TransferIdReused
from kvwire.handshake.types import EngineInfo
from kvwire.integrations.api import Endpoint, close_all, open_ranks, remote_engine, start_connector
from kvwire.metrics import HandshakeStats, KvMetrics, TransferStats
from kvwire.protocol.messages import TransferMode
from kvwire.transport.base import Agent, PeerMode


class _Hooks:
    def __init__(self, connector: Producer | Consumer, agents: list[Agent]) -> None:
        self.connector = connector
        self._agents = agents
        self._closed = False

    def bind(self, wake: Callable[[], None]) -> None:
        # Every connector event wakes the engine: a waiting engine sleeps instead of polling, which on a
        # few cores would take CPU from the prefill whose KV it waits for.
        self.connector.on_event(wake)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close_all([self.connector], self._agents)


class ProducerHooks(_Hooks):
    connector: Producer

    def request_finished(self, req: TransferRequest) -> bool:
        """Whether the connector holds the blocks; not for a transfer id another held request has (the
        blocks go back at once, and D's registration for it is answered by the one that holds it)."""
        try:
            self.connector.request_finished(req.transfer_id, req.block_ids, req.num_tokens)
        except TransferIdReused:
            logging.getLogger(__name__).warning(
                "transfer id %s is held by another request: not sent", req.transfer_id
            )
            return False
        return True

    def request_allocated(self, req: TransferRequest) -> None:
        raise InvalidRequest("a prefill engine does not load KV")

    def abort(self, transfer_id: str) -> None:
        self.connector.abort(transfer_id)

    def decline(self, req: TransferRequest) -> None:
        return None  # a prefill engine loads nothing

    def poll(self) -> HookEvents:
        return HookEvents(producer=self.connector.poll())


class ConsumerHooks(_Hooks):
    connector: Consumer

    def request_finished(self, req: TransferRequest) -> bool:
        return False

    def request_allocated(self, req: TransferRequest) -> None:
        remote = remote_engine(req.params)  # one listener serves every rank of a kvwire engine
        self.connector.request_allocated(req.transfer_id, req.block_ids, req.num_tokens, 0, remote)

    def abort(self, transfer_id: str) -> None:
        self.connector.abort(transfer_id)

    def decline(self, req: TransferRequest) -> None:
        self.connector.decline(req.transfer_id, remote_engine(req.params))

    def poll(self) -> HookEvents:
        return HookEvents(consumer=self.connector.poll())


@dataclass(frozen=True)
class ConnectorSettings:
    engine_id: str
    incarnation: str
    model_id: str
    mode: TransferMode = TransferMode.PUSH
    backend: str = "nixl"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None  # KVWIRE_SIDE_CHANNEL_HOST: what peers dial, when host is 0.0.0.0
    secret: bytes | None = None
    accept_secret: bytes | None = None  # KVWIRE_SECRET_ACCEPT
    config: ConnectorConfig = field(default_factory=ConnectorConfig)


def attach_connector(engine: Engine, s: ConnectorSettings) -> ProducerHooks | ConsumerHooks:
    """Build, start and plug in the connector of a prefill or decode engine; its side channel port is
    ``hooks.connector.port``."""
    role = engine.cfg.role
    if role is Role.COLOCATED:
        raise ConfigError("a colocated engine has no KV connector")
    kv = engine.kv
    info = EngineInfo(s.engine_id, s.incarnation, s.model_id, kv.spec, kv.tp_size, kv.pp_size, s.mode)
    caches = sorted(kv.caches.items())
    agents, ranks = open_ranks(
        s.backend,
        s.engine_id,
        s.incarnation,
        caches,
        s.config.handshake_timeout_s,
        s.advertise_host or s.host,
    )
    try:
        config = dataclasses.replace(s.config, mode=s.mode)
        at = Endpoint(s.host, s.port, s.advertise_host, s.secret, s.accept_secret)
        cls: type[Producer] | type[Consumer] = Producer if role is Role.PREFILL else Consumer
        connector: Producer | Consumer = start_connector(cls, info, ranks, config, at)
    except BaseException:
        close_all((), agents)
        raise
    hooks: ProducerHooks | ConsumerHooks
    if isinstance(connector, Producer):
        hooks = ProducerHooks(connector, agents)
    else:
        hooks = ConsumerHooks(connector, agents)
    engine.set_hooks(hooks)
    return hooks


class ConnectorMetrics:
    """Feeds a ``KvMetrics`` from a connector's cumulative counters (call ``sync`` before each scrape)."""

    def __init__(self, connector: Producer | Consumer, metrics: KvMetrics) -> None:
        self.connector = connector
        self.metrics = metrics
        self._transfers = 0
        self._bytes = 0
        self._failures: dict[Any, int] = {}
        self._dropped: dict[str, int] = {}
        self._digests = 0
        self._declined = 0
        self._handshakes: dict[tuple[Any, PeerMode], int] = {}
        self._guards = Deltas()  # side-channel refusals and breaker fast failures seen so far

    def sync(self) -> None:
        st = self.connector.stats
        new = st.transfers_done - self._transfers
        if new > 0 and posts_transfers(self.connector):
            durations = st.transfer_durations_s[-new:] or [0.0]
            per = (st.bytes_moved - self._bytes) // new
            for i in range(new):
                secs = durations[i] if i < len(durations) else durations[-1]
                self.metrics.record_transfer(TransferStats(self.connector.config.mode, per, secs))
        self._transfers, self._bytes = st.transfers_done, st.bytes_moved
        if st.digests > self._digests:
            self.metrics.record_digests(st.digests - self._digests)
            self._digests = st.digests
        if st.declined > self._declined:
            self.metrics.record_declined(st.declined - self._declined)
            self._declined = st.declined
        for why, count in list(st.dropped_notifs.items()):
            if count > self._dropped.get(why, 0):
                self.metrics.record_dropped(why, count - self._dropped.get(why, 0))
                self._dropped[why] = count
        for reason, count in st.failures.items():
            for _ in range(count - self._failures.get(reason, 0)):
                self.metrics.record_failure(reason)
            self._failures[reason] = count
        self._sync_guards()
        for key, mgr in self.connector.managers.items():
            for mode in PeerMode:
                done = mgr.stats.handshakes[mode]
                seen = self._handshakes.get((key, mode), 0)
                recent = list(mgr.stats.durations_s[mode])
                if done <= seen:
                    continue
                # Durations are not kept per peer: name the local rank and the engines it knows.
                remotes = ",".join(sorted({p.engine_id for p in mgr.peers()})) or "?"
                peer = f"{self.connector.engine.engine_id} pp{key[0]}/tp{key[1]} -> {remotes}"
                for secs in recent[len(recent) - min(done - seen, len(recent)) :]:
                    self.metrics.record_handshake(HandshakeStats(peer=peer, mode=mode, seconds=secs))
                self._handshakes[(key, mode)] = done

    def _sync_guards(self) -> None:
        for what, new in self._guards.take(guard_totals(self.connector)).items():
            if what == "circuit_open":
                self.metrics.record_circuit_open(new)
            elif what.startswith("refusal:"):
                self.metrics.record_side_refusals(what.removeprefix("refusal:"), new)
            elif what.startswith("handshake:"):
                self.metrics.record_handshake_failures(what.removeprefix("handshake:"), new)
            else:
                self.metrics.record_refused_connections(what.removeprefix("refused:"), new)
