"""The connector's knobs (names follow vLLM's where it has one), validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvwire.errors import ConfigError
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.messages import TransferMode


class LoadFailurePolicy(enum.Enum):
    """What D does with a request whose KV could not be loaded (vLLM's ``kv_load_failure_policy``)."""

    FAIL = "fail"  # end the request with an error to the client
    RECOMPUTE = "recompute"  # prefill locally, once the connector has released the blocks


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Timeouts are in seconds unless the name says otherwise; every wait the connector does is bounded."""

    mode: TransferMode = TransferMode.PUSH
    # Push only: P writes each layer's KV as soon as the engine says it is computed (``LayersReady``),
    # overlapping the transfer with the rest of the prefill; D still gets one done after every layer landed.
    layerwise: bool = False
    # P keeps a finished request's blocks this long for D to register (or read); D's heartbeats extend it.
    kv_lease_duration_s: float = 30.0
    # P starts no write more than this after it received the push_reg (D's value is sent in the push_reg).
    fence_ms: int = 30_000
    heartbeat_interval_s: float = 1.0
    # A peer silent this long (no notification of any kind) while we hold transfers with it is dead.
    liveness_timeout_s: float = 5.0
    # After a peer is declared dead, and again after the word that confirms a dead P life, D waits this
    # long before reusing blocks registered to it: a frozen peer that resumes could still finish a write it
    # had posted, and after a healed partition the old connection still drains what the kernels held.
    dead_peer_grace_s: float = 1.0
    # After the grace, D still keeps a dead P life's target blocks quarantined until that life is confirmed
    # (it spoke again, which it does only after recalling its writes, or another life answered at its
    # address, or nobody listens there), at most this long: a frozen P thawed later could land a write
    # it had posted.
    dead_quarantine_s: float = 30.0
    # A posted transfer still in progress after this is released and reported failed (NIXL #2047).
    transfer_timeout_s: float = 30.0
    # Peers unused this long are reaped (agents removed, descriptors released).
    engine_ttl_s: float = 3600.0
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL
    handshake_timeout_s: float = 5.0
    handshake_retries: int = 3
    # How often the background loop progresses the agents and drains notifications: fast while
    # transfers are live, slower when idle (NIXL has no descriptor to wait on).
    poll_interval_s: float = 0.0005
    idle_poll_interval_s: float = 0.002
    # How long P remembers an ended registration, to answer a late cancel or push_reg correctly.
    tombstone_s: float = 60.0
    # P: ended requests remembered at most (oldest forgotten first, before tombstone_s): a flood of
    # push_regs with a 1 ms fence ends thousands of requests a second, each a tombstone.
    max_tombstones: int = 65_536
    # P: registrations for requests it has not finished yet (D registers while P prefills) at most; more
    # are dropped (counted as "overload"): one peer's flood of push_regs cannot grow P without bound.
    max_early_registrations: int = 4096
    # ...and from one D engine life at most: one peer cannot fill the table for every other D.
    max_early_registrations_per_peer: int = 1024
    # ...and D's block ids they name, in all (+1 per registration): a 4 MiB push_reg names ~800k ids, about
    # 30 MB once decoded, so the count alone bounded nothing in bytes. 4M ids: 64 registrations of a
    # 1M-token prompt at 16 tokens a block at once.
    max_early_block_ids: int = 1 << 22
    # P: registrations (and remembered cancels) one request holds at most, per 8 ranks a core holds (one
    # per (P rank, D rank) pair: a vLLM rank pairs with at most D's tp, 64), and the table in all, tombstones
    # included (the oldest tombstones holding some make room first): a push_reg or a cancel for a request
    # P holds or ended was bounded by nothing, each a handshake or an ack and a record.
    max_registrations_per_request: int = 256
    max_registrations: int = 1 << 18
    # P: D's block ids every registration holds, in all (an early one's count against max_early_block_ids
    # too): a registration of a held request keeps its ids until its handshake and write end (a handshake
    # with an address that never answers: ~20 s), 8M ids about 300 MB decoded at worst.
    max_block_ids: int = 1 << 23
    # D: transfer ids this life has served, remembered (oldest forgotten first) so that a new request
    # reusing one is refused. Past the bound an id can be registered again; its registration gets a new
    # reg_nonce, so a done of the old one still does not match it (docs/protocol.md).
    max_served_ids: int = 65_536
    # D (push): the share of requests whose KV bytes are checked against a digest P computes over its
    # source (CRC-32 of the written tokens; about 1 s of one core per GB on each side, docs/benchmarks.md):
    # 1.0 every request (tests, benchmarks), 0.0 none. Chosen per transfer id, deterministically.
    kv_digest_sample: float = 0.0
    # The peers this engine may dial (CIDRs, addresses, host names; comma-separated; empty: any). Without
    # a secret this is what stops a request or a notification from naming any address (handshake/allow.py).
    allowed_peers: str = ""

    def __post_init__(self) -> None:
        positive = {
            "kv_lease_duration_s": self.kv_lease_duration_s,
            "fence_ms": self.fence_ms,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "liveness_timeout_s": self.liveness_timeout_s,
            "transfer_timeout_s": self.transfer_timeout_s,
            "engine_ttl_s": self.engine_ttl_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "poll_interval_s": self.poll_interval_s,
            "idle_poll_interval_s": self.idle_poll_interval_s,
            "tombstone_s": self.tombstone_s,
            "dead_quarantine_s": self.dead_quarantine_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")
        if not 0.0 <= self.kv_digest_sample <= 1.0:
            raise ConfigError(f"kv_digest_sample must be in [0, 1], got {self.kv_digest_sample!r}")
        bounds = (
            "max_early_registrations",
            "max_early_registrations_per_peer",
            "max_early_block_ids",
            "max_served_ids",
            "max_tombstones",
            "max_registrations_per_request",
            "max_registrations",
            "max_block_ids",
        )
        for name in bounds:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        PeerAllowList.parse(self.allowed_peers)  # ConfigError naming a bad entry
        if self.dead_peer_grace_s < 0 or self.handshake_retries < 0:
            raise ConfigError("dead_peer_grace_s and handshake_retries must not be negative")
        if self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"liveness_timeout_s ({self.liveness_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or live peers would be declared dead"
            )
