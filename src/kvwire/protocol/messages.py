"""Wire contract v1: every message kvwire sends, as msgspec Structs.

Two channels (see ``docs/protocol.md``):

* the **side channel** (TCP, one listener per engine): length-prefixed msgpack frames carrying
  ``GetMetadata`` requests and ``Metadata`` or ``ErrorReply`` replies (``Sealed`` ones with a secret);
* **notifications** through NIXL (``send_notif`` or attached to a WRITE): ``b"KVW1"`` + msgpack.

Compatibility rules: fields may be added with defaults; removing or retyping one bumps ``VERSION``.
Unknown fields are ignored (msgspec does so by default); unknown ``type`` tags are refused.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from kvwire.protocol.limits import MAX_HEARTBEAT_IDS, MAX_ID_CHARS, MAX_NOTIF_BYTES

VERSION = 1
NOTIF_MAGIC = b"KVW1"
MAX_FRAME_BYTES = 16 * 1024 * 1024

# Value constraints are checked on decode only (constructing a Struct does not validate). They do not change
# the encoding: a peer that sends a negative rank or block id is refused as malformed, before any lookup.
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Version = Annotated[int, msgspec.Meta(ge=1)]
MAX_PORT = 65535
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT)]
# A ``FailReason`` value as a peer sent it: a newer peer's may be one this version does not know.
ReasonText = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
# A content digest (CRC-32 today: 4 bytes); longer is refused as malformed before it is kept anywhere.
DigestBytes = Annotated[bytes, msgspec.Meta(max_length=64)]
IdText = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
MAX_CLAIM_BLOCKS = 1 << 20  # a claim names P's blocks of one request: 16 Mi tokens at 16 per block
# A host name or address as dialled: DNS names are at most 253 characters. Kept by bounded tables and
# logged, so a 4 MiB one (the notification's bound) must not get that far.
HostText = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]


class TransferMode(enum.Enum):
    """Who moves the bytes: in PUSH P writes into D's blocks, in PULL D reads P's blocks."""

    PUSH = "push"
    PULL = "pull"


class ErrorCode(enum.Enum):
    INCOMPATIBLE = "incompatible"
    UNAUTHORIZED = "unauthorized"
    NO_SUCH_RANK = "no_such_rank"
    BAD_REQUEST = "bad_request"
    # Added (v1-compatible): a ``claim`` for a transfer this engine held and let go (ended, expired).
    GONE = "gone"
    # Added (v1-compatible): a ``claim`` for a transfer this engine has not finished (yet: a P worker may
    # get the request's end a step after P's answer reached D; the claimer asks again for a while).
    NOT_YET = "not_yet"


class FailReason(enum.Enum):
    """Why a registration ended in ``failed``."""

    WRITE_FAILED = "write_failed"
    POST_FAILED = "post_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    FENCE_EXPIRED = "fence_expired"
    LEASE_EXPIRED = "lease_expired"
    BAD_REGISTRATION = "bad_registration"
    INCOMPATIBLE = "incompatible"
    HANDSHAKE_FAILED = "handshake_failed"
    PEER_DEAD = "peer_dead"
    ABORTED = "aborted"
    SHUTDOWN = "shutdown"
    # P's table of registrations waiting for their prefill (max_early_registrations) was full: try later.
    OVERLOADED = "overloaded"
    # D only, never sent: the peer's side channel refused our credentials (a secret on one side only).
    UNAUTHORIZED = "unauthorized"
    # D only: a ``done`` that does not match what D registered (num_blocks, reg_nonce, nbytes), or that
    # states nothing (a peer older than those fields): the KV cannot be trusted.
    BAD_DONE = "bad_done"
    # D only: the bytes that landed do not hash to the digest P stated in ``done`` (or P stated none when
    # D asked for one).
    DIGEST_MISMATCH = "digest_mismatch"
    # P: the push_reg names fewer tokens than P prefilled (a prefix would be served as the whole prompt).
    SHORT_REGISTRATION = "short_registration"
    # P: D asked for a digest (want_digest) and this P rank cannot compute one (its KV is not in host
    # memory); nothing under way (layer-wise, the earlier layers' WRITEs completed). Said, rather than a
    # done without a digest that D would call a mismatch.
    DIGEST_UNAVAILABLE = "digest_unavailable"
    # A reason this version does not know (a newer peer's): still a failure, never a dropped message.
    UNKNOWN = "unknown"


# --- side channel ----------------------------------------------------------------------------------


class GetMetadata(msgspec.Struct, tag="get_metadata", tag_field="type", kw_only=True):
    version: Version = VERSION
    pp_rank: NonNeg
    tp_rank: NonNeg
    # Added field (v1-compatible): a notif-only caller only needs connection info, not the regions.
    notif_only: bool = False
    nonce: bytes | None = None
    auth: bytes | None = None
    # Added fields (v1-compatible), required with a shared secret: the side channel the request was meant
    # for, as dialled ("host:port"), and the requester's wall clock in ms (see protocol/auth.py).
    target: str | None = None
    ts_ms: int | None = None


class KVInfo(msgspec.Struct, kw_only=True):
    num_layers: Positive
    first_layer: NonNeg
    kv_heads: Positive
    head_dim: Positive
    dtype: str
    block_size: Positive
    layout: str  # "HND" | "NHD"
    mla: bool
    kv_fused: bool = False  # K and V of a head together in each block: one "kv" region per layer
    kv_tiles: bool = False  # fused as a K tile then a V tile per head (vLLM's CPU backend), not [K|V] rows
    # A hybrid model's KV cache groups (kv/groups.py): each layer's group, each group's sliding window.
    layer_groups: list[NonNeg] = []
    group_windows: list[NonNeg] = []


class RegionMsg(msgspec.Struct, kw_only=True):
    layer: NonNeg
    kind: str  # "k" | "v" | "kv"
    base_addr: NonNeg
    block_len: Positive
    num_blocks: NonNeg
    device_id: NonNeg = 0


class CompatFields(msgspec.Struct, kw_only=True, frozen=True):
    """The values the compat hash covers (``protocol/compat.py``), sent beside it so that the side that
    finds the hashes differ can say which values differ instead of only that they do."""

    model_id: str
    dtype: str
    num_layers: Positive
    kv_heads: Positive
    head_dim: Positive
    layout: str  # "HND" | "NHD"
    mla: bool
    transfer_mode: TransferMode
    kv_fused: bool = False


class Metadata(msgspec.Struct, tag="metadata", tag_field="type", kw_only=True):
    version: Version = VERSION
    engine_id: str
    incarnation: str
    compat_hash: str
    tp_size: Positive
    tp_rank: NonNeg
    pp_size: Positive
    pp_rank: NonNeg
    agent_name: str
    agent_metadata: bytes
    kv: KVInfo
    num_blocks: NonNeg
    regions: list[RegionMsg] = []
    server_time: float = 0.0
    notif_only: bool = False
    # Added field (v1-compatible): what compat_hash covers, so a mismatch can be explained (None from
    # peers that predate it: then only the hashes are compared).
    compat: CompatFields | None = None


class ErrorReply(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    version: Version = VERSION
    code: ErrorCode
    message: str


class Sealed(msgspec.Struct, tag="sealed", tag_field="type", kw_only=True):
    """A reply to a signed request, encrypted and authenticated under the shared secret
    (``protocol/seal.py``): ``box`` opens to one encoded ``Metadata`` or ``ErrorReply``."""

    version: Version = VERSION
    nonce: bytes
    box: bytes


class ReportFailed(msgspec.Struct, tag="report_failed", tag_field="type", kw_only=True):
    """P tells D, on D's side channel, that it ended D's registration failed when no notification can
    carry it: P's handshake with D failed (incompatible, refused, bad or no answer). Without it D would
    wait for its liveness timeout. Authenticated as ``get_metadata`` (``protocol/auth.py``); answered
    ``ack`` or ``error``."""

    version: Version = VERSION
    # D's rank whose registration it was (the push_reg's tp_rank; D runs with pp_size 1), and D's life
    # that sent the push_reg: a newer life at the same address refuses the report.
    pp_rank: NonNeg
    tp_rank: NonNeg
    to_incarnation: IdText
    # The ``failed`` notification P would have sent: P's identity and rank, the transfer, the reason.
    # Bounded as in the notification (a longer id was acked, then dropped as malformed when re-encoded).
    transfer_id: IdText
    engine_id: IdText
    incarnation: IdText
    from_pp_rank: NonNeg
    from_tp_rank: NonNeg
    # The reason as sent (``auth`` covers these exact characters), not a ``FailReason``: a reason this
    # version does not know still ends D's registration at once (``fail_reason``), as the same reason in
    # a ``failed`` notification does, instead of the report being refused as malformed.
    reason: ReasonText
    nonce: bytes | None = None
    auth: bytes | None = None
    target: str | None = None
    ts_ms: int | None = None

    @property
    def fail_reason(self) -> FailReason:
        """``reason`` as a ``FailReason``; ``UNKNOWN`` for one this version does not know."""
        return _REASONS.get(self.reason, FailReason.UNKNOWN)


_REASONS = {r.value: r for r in FailReason}


class Ack(msgspec.Struct, tag="ack", tag_field="type", kw_only=True):
    """The answer to a ``report_failed`` that was taken."""

    version: Version = VERSION


class Claim(msgspec.Struct, tag="claim", tag_field="type", kw_only=True):
    """Pull mode: D asks P, on P's side channel, before it reads a request's blocks from one P rank,
    whether P still holds those blocks for that transfer. P answers ``granted`` (and keeps them at least
    ``lease_ms`` from then, and until this D rank's ``done`` or ``failed``) or ``error`` (``gone``: not
    held; ``bad_request``: other blocks). Without it a D that came after P's lease read blocks P had
    freed and reused, and decoded another request's KV as this one's. Authenticated as
    ``get_metadata``; its answer, ``granted`` included, goes sealed under a secret."""

    version: Version = VERSION
    pp_rank: NonNeg  # P's rank to be read
    tp_rank: NonNeg
    to_incarnation: IdText  # P's life the request's parameters named
    transfer_id: IdText
    block_ids: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_CLAIM_BLOCKS)]
    # The claimer: D's engine, life and rank (P waits for the ``done`` or ``failed`` of each).
    engine_id: IdText
    incarnation: IdText
    from_pp_rank: NonNeg
    from_tp_rank: NonNeg
    # D's TP size: P holds the blocks until every D rank that reads them ended, those that have not
    # claimed yet included (a slower rank's claim must not find them freed by a faster one's ``done``).
    tp_size: Positive = 1
    # As ``PushReg.idle_ranks``: D's idle-rank tellers say ``done`` to the P ranks no D rank reads, so P
    # waits for them. Not signed: it only decides whether P waits for a rank that moves nothing.
    idle_ranks: bool = False
    nonce: bytes | None = None
    auth: bytes | None = None
    target: str | None = None
    ts_ms: int | None = None


class Granted(msgspec.Struct, tag="granted", tag_field="type", kw_only=True):
    """P's answer to a ``claim`` it holds: the blocks stay P's for this transfer at least ``lease_ms``
    from when P answered (D's heartbeats extend it), and until the claimer's ``done`` or ``failed``."""

    version: Version = VERSION
    lease_ms: Positive


SideMessage = GetMetadata | Metadata | ErrorReply | Sealed | ReportFailed | Ack | Claim | Granted


# --- notifications ---------------------------------------------------------------------------------


class _Notif(msgspec.Struct, kw_only=True):
    version: Version = VERSION
    transfer_id: IdText
    engine_id: IdText
    incarnation: IdText


class PushReg(_Notif, tag="push_reg", tag_field="type", kw_only=True):
    tp_rank: NonNeg
    tp_size: Positive
    host: HostText
    port: Port
    block_ids: list[NonNeg]
    num_tokens: NonNeg
    num_cached_tokens: NonNeg = 0
    fence_ms: Positive = 30_000
    # Added fields (v1-compatible). A number this D life gives no other registration (never 0): P echoes it
    # in its ``done``, so a ``done`` of another registration (a replay) does not match this one.
    reg_nonce: NonNeg = 0
    # D asks P for a content digest of what it writes (``Done.digest``; docs/protocol.md §3).
    want_digest: bool = False
    # D registers with the P ranks no D rank reads too (``kv.mapping.tp_contacts``): P waits for that
    # word only from a D that says so (one from before it never sends it).
    idle_ranks: bool = False


class Done(_Notif, tag="done", tag_field="type", kw_only=True):
    tp_rank: NonNeg
    pp_rank: NonNeg
    num_blocks: NonNeg
    # Added fields (v1-compatible): what P wrote for this registration. The push_reg's ``reg_nonce``, the
    # KV bytes of tokens [num_cached_tokens, num_tokens) it wrote into this D rank (kv/digest.py), and,
    # when D asked, their digest (CRC-32, 4 bytes big-endian). D refuses a ``done`` without them.
    reg_nonce: NonNeg = 0
    nbytes: NonNeg | None = None
    digest: DigestBytes | None = None


class Failed(_Notif, tag="failed", tag_field="type", kw_only=True):
    tp_rank: NonNeg
    pp_rank: NonNeg
    reason: FailReason


class Cancel(_Notif, tag="cancel", tag_field="type", kw_only=True):
    pass


class CancelAck(_Notif, tag="cancel_ack", tag_field="type", kw_only=True):
    tp_rank: NonNeg
    pp_rank: NonNeg
    wrote: bool


class Heartbeat(_Notif, tag="heartbeat", tag_field="type", kw_only=True):
    # transfer_id is unused on heartbeats ("" by convention); the live set is in transfer_ids (a longer
    # one goes in several heartbeats: ``id_batches``).
    transfer_ids: Annotated[list[IdText], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = []


def id_batches(ids: list[str]) -> list[list[str]]:
    """``ids`` in heartbeat-sized parts (one part, maybe empty, when they fit): at most
    ``MAX_HEARTBEAT_IDS`` ids and, counting each id's UTF-8 bytes and msgpack header, half of
    ``MAX_NOTIF_BYTES`` (16,384 ids of 1,024 characters would be 16 MiB: a heartbeat its peer refuses)."""
    budget = MAX_NOTIF_BYTES // 2
    out: list[list[str]] = [[]]
    size = 0
    for tid in ids:
        cost = len(tid.encode()) + 5
        if len(out[-1]) == MAX_HEARTBEAT_IDS or (out[-1] and size + cost > budget):
            out.append([])
            size = 0
        out[-1].append(tid)
        size += cost
    return out


Notification = PushReg | Done | Failed | Cancel | CancelAck | Heartbeat
