"""Typed messages of the vLLM integration: the connector's settings (``kv_connector_extra_config``), the
``RemoteEngine`` a request's ``kv_transfer_params`` (``kvwire.kv_params``) designate, and the per-step
operations the scheduler side hands the workers. No vLLM import: the scheduler and worker logic is
testable without vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvwire.config import ENV_SIDE_CHANNEL_HOST, WILDCARD_HOSTS, env_config
from kvwire.core.config import ConnectorConfig
from kvwire.errors import ConfigError, InvalidRequest
from kvwire.kv_params import KvTransferParams, parse_kv_params
from kvwire.protocol.limits import MAX_ID_CHARS
from kvwire.protocol.messages import TransferMode
from kvwire.startup import check_exposure

DEFAULT_SIDE_CHANNEL_PORT = 5700  # vLLM's NIXL connector uses 5600: both can run on one host
_DEFAULTS = ConnectorConfig()  # the knobs below default to the connector's own defaults


class KvRole(enum.Enum):
    """vLLM's ``kv_role``."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        return self is not KvRole.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not KvRole.PRODUCER


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kv_connector_extra_config`` keys; timeouts and knobs keep ``ConnectorConfig``'s names."""

    mode: TransferMode = TransferMode.PUSH
    # Push: P writes each layer's KV to D as soon as vLLM computed it (save_kv_layer), overlapping the
    # transfer with the rest of the prefill (layerwise.py); D still decodes only once every layer landed.
    layerwise: bool = False
    backend: str = "nixl"
    # Where this engine's side channel listens: rank (pp, tp) of a tp_size engine at
    # side_channel_port + pp * tp_size + tp. The host is also what D is told to connect to.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # Without KVWIRE_SECRET a non-loopback side_channel_host is refused unless this is set (trusted network):
    # anyone who reaches an unauthenticated side channel gets the region map, and can write into D's KV.
    insecure: bool = False
    model_id: str | None = None  # default: served name, revision and dtype (identity.vllm_model_id)
    incarnation: str | None = None  # default: derived from this vLLM config's instance id
    kv_lease_duration_s: float = _DEFAULTS.kv_lease_duration_s
    fence_ms: int = _DEFAULTS.fence_ms
    heartbeat_interval_s: float = _DEFAULTS.heartbeat_interval_s
    liveness_timeout_s: float = _DEFAULTS.liveness_timeout_s
    dead_peer_grace_s: float = _DEFAULTS.dead_peer_grace_s
    dead_quarantine_s: float = _DEFAULTS.dead_quarantine_s
    transfer_timeout_s: float = _DEFAULTS.transfer_timeout_s
    engine_ttl_s: float = _DEFAULTS.engine_ttl_s
    handshake_timeout_s: float = _DEFAULTS.handshake_timeout_s
    handshake_retries: int = _DEFAULTS.handshake_retries
    poll_interval_s: float = _DEFAULTS.poll_interval_s
    idle_poll_interval_s: float = _DEFAULTS.idle_poll_interval_s
    tombstone_s: float = _DEFAULTS.tombstone_s
    max_early_registrations: int = _DEFAULTS.max_early_registrations
    max_early_registrations_per_peer: int = _DEFAULTS.max_early_registrations_per_peer
    max_early_block_ids: int = _DEFAULTS.max_early_block_ids
    max_tombstones: int = _DEFAULTS.max_tombstones
    max_registrations_per_request: int = _DEFAULTS.max_registrations_per_request
    max_registrations: int = _DEFAULTS.max_registrations
    max_block_ids: int = _DEFAULTS.max_block_ids
    max_served_ids: int = _DEFAULTS.max_served_ids
    # The digest reads host memory: a D with a GPU cache refuses to start with it above 0, and a P with
    # one sends none (a D asking it fails those requests): leave 0 unless both caches are in host memory.
    kv_digest_sample: float = _DEFAULTS.kv_digest_sample
    allowed_peers: str = _DEFAULTS.allowed_peers
    # A step with nothing scheduled while transfers are live (vLLM steps back to back while a request
    # waits for KV or P holds blocks): the worker sleeps up to this long, woken at once by any kvwire
    # event, instead of spinning engine and worker processes through empty steps. 0 turns it off.
    idle_step_wait_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 5.0
    # etcd://HOST:PORT[/prefix]: the scheduler registers the engine there (docs/fleet.md), at discovery_url
    # (this vLLM server's http://HOST:PORT), under a lease of discovery_ttl_s.
    discovery: str | None = None
    discovery_url: str | None = None
    discovery_ttl_s: int = 5

    def connector_config(self) -> ConnectorConfig:
        names = {f.name for f in dataclasses.fields(ConnectorConfig)}
        values = {k: getattr(self, k) for k in self.__struct_fields__ if k in names}
        return ConnectorConfig(**values)

    def rank_port(self, pp_rank: int, tp_rank: int, tp_size: int) -> int:
        return self.side_channel_port + pp_rank * tp_size + tp_rank


def check_deployment(*, speculative: bool, decode_cp: int, prefill_cp: int) -> None:
    """What kvwire does not move, refused at start by its name (it failed later, or silently, before).
    ``speculative``: a speculative method with KV cache layers of its own (a drafter: EAGLE, MTP, a
    draft model); n-gram and suffix decoding add none and pass."""
    if speculative:
        raise ConfigError(
            "kvwire: speculative decoding with a drafter (EAGLE, MTP, a draft model) is not supported: the "
            "drafter's KV cache layers are not moved (the engine refused its layers at start). Run without "
            "it, or with a method that keeps no KV (ngram, suffix)"
        )
    if decode_cp > 1 or prefill_cp > 1:
        raise ConfigError(
            f"kvwire: context parallelism (decode_context_parallel_size {decode_cp}, "
            f"prefill_context_parallel_size {prefill_cp}) is not supported: a rank holds a shard of each "
            "block's tokens (every load failed). Run with 1"
        )


def for_dp_engine(s: Settings, dp_index: int, tp: int, pp: int, role: KvRole) -> Settings:
    """The settings of data-parallel engine ``dp_index``: vLLM starts every DP engine from one
    ``kv_transfer_config``, so each takes the next ``tp * pp`` side-channel ports (twice that for
    kv_both), as vLLM's NIXL connector offsets its port by the DP index."""
    if dp_index == 0:
        return s
    if s.discovery:
        raise ConfigError(
            "kv_connector_extra_config discovery: not supported with data parallelism yet (every DP engine "
            "would register a record for the one server URL): list the engines to the router instead, one "
            "URL per DP rank (docs/vllm.md, data parallelism), or use pull mode"
        )
    span = tp * pp * (2 if role is KvRole.BOTH else 1)
    port = s.side_channel_port + dp_index * span
    if port + span > 65536:
        raise ConfigError(f"kv_connector_extra_config: side_channel_port {s.side_channel_port} leaves no "
                          f"room for data-parallel engine {dp_index} ({span} ports each)")  # fmt: skip
    return msgspec.structs.replace(s, side_channel_port=port)


def settings_from_extra(extra: Mapping[str, Any] | None) -> Settings:
    """Parse ``kv_connector_extra_config``; a wrong key or value names itself."""
    if "kv_load_failure_policy" in (extra or {}):
        # Accepted and ignored before: vLLM decides what a failed load does, from its own config.
        raise ConfigError(
            "kv_connector_extra_config: kv_load_failure_policy is vLLM's setting under vLLM: set it in "
            'kv_transfer_config ("kv_load_failure_policy": "recompute" or "fail"), not in the extra config'
        )
    try:
        s = msgspec.convert(dict(extra or {}), Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from exc
    if s.layerwise and s.mode is not TransferMode.PUSH:
        raise ConfigError("kv_connector_extra_config: layerwise needs mode push (in pull D reads P's blocks)")
    s.connector_config()  # validate the knobs now, in the engine's start-up, not at the first request
    if not 0 < s.side_channel_port < 65536:
        raise ConfigError(f"kv_connector_extra_config: side_channel_port {s.side_channel_port} out of range")
    _check_host(s.side_channel_host, "kv_connector_extra_config side_channel_host", s.insecure)
    if s.discovery is not None:
        from kvwire.discovery.source import check_target  # a source's client: loaded only when asked for

        check_target(s.discovery)
        if not s.discovery_url or s.discovery_ttl_s < 1:
            raise ConfigError(
                "kv_connector_extra_config: discovery needs discovery_url and discovery_ttl_s >= 1"
            )
    return s


def _check_host(host: str, where: str, insecure: bool) -> None:
    if host in WILDCARD_HOSTS:
        raise ConfigError(
            f"{where} {host!r}: it is also the address D is told to dial (D would dial itself): set this "
            "host's address that D reaches"
        )
    env = env_config()
    check_exposure(host, env.secret, insecure, where, 'set "insecure": true', accept=env.accept_secret)


def rank_host(s: Settings, environ: Mapping[str, str] | None = None) -> str:
    """The host this process's side channels bind and advertise: ``KVWIRE_SIDE_CHANNEL_HOST`` when set,
    else ``side_channel_host``. vLLM starts every node of a multi-node engine from one
    ``kv_transfer_config``, so a node's own address comes from its environment (vLLM's NIXL connector
    reads ``VLLM_NIXL_SIDE_CHANNEL_HOST`` the same way); ``ConfigError`` for an address D cannot dial."""
    host = env_config(environ).side_channel_host
    if host is None:
        return s.side_channel_host
    _check_host(host, ENV_SIDE_CHANNEL_HOST, s.insecure)
    return host


class RankChannel(msgspec.Struct, frozen=True):
    """Where one worker's side channel listens, as it tells its scheduler (vLLM's handshake metadata,
    gathered from every worker at start): the scheduler names each rank's host in P's answer."""

    host: str
    port: int


def incarnation_of(engine_id: str, instance_id: str) -> str:
    """One id per engine start, the same in the scheduler and every worker process (they share the
    config's instance id), different after a restart."""
    return hashlib.sha256(f"{engine_id}/{instance_id}".encode()).hexdigest()[:16]


def parse_params(raw: object) -> KvTransferParams | None:
    """A request's ``kv_transfer_params`` as vLLM hands them (any client library's JSON: numbers and
    booleans may arrive as strings, so not strict); ``InvalidRequest`` when malformed."""
    return parse_kv_params(raw, strict=False)


def send_id(params: KvTransferParams, req_id: str) -> str:
    """P: the transfer id a request's KV is held under: the router's ``transfer_id``, else vLLM's request
    id, hashed when longer than an id may be on the wire (vLLM takes it from a client's X-Request-Id: a
    longer one went out in P's answer, every D refused it, and P held the blocks to its lease)."""
    tid = params.transfer_id or req_id
    if len(tid) <= MAX_ID_CHARS:
        return tid
    return "req-sha256-" + hashlib.sha256(tid.encode()).hexdigest()


def load_id(params: KvTransferParams) -> str:
    """D: the transfer id to load under (``transfer_id``, else ``remote_request_id``, as vLLM's proxies
    name it); ``InvalidRequest`` when neither is given: D's own request id was used, which no P holds, and
    the load waited for P's fence or lease (30 s) to fail."""
    tid = params.transfer_id or params.remote_request_id
    if tid is None:
        raise InvalidRequest(
            "kv_transfer_params with do_remote_prefill need transfer_id (or remote_request_id): pass P's "
            "answer on as it is",
            "kv_transfer_params",
        )
    return tid


class OpKind(enum.Enum):
    SEND = "send"  # P: the request finished prefill; hold its blocks for D (push: write; pull: D reads)
    LOAD = "load"  # D: blocks allocated for the remote prefix; register with P (push) or read (pull)
    ABORT = "abort"  # D: the engine dropped a request waiting for KV
    DECLINE = "decline"  # D: a request whose KV it will not load (dropped unallocated, or a full local hit)
    DROP = "drop"  # P: the engine dropped a request D may register for: D's registration fails at once
    STREAM = "stream"  # P, layerwise: this step ends the request's prefill; write its layers as computed


class Op(msgspec.Struct, frozen=True, array_like=True):
    """One step's instruction from the scheduler side to every worker (in ``KvwireMetadata``)."""

    kind: OpKind
    req_id: str
    transfer_id: str
    block_ids: list[int] = msgspec.field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    remote: KvTransferParams | None = None
