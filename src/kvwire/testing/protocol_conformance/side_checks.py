"""Checks over the side channel (docs/protocol.md §1, §2, §4, §5): good answers and every documented
refusal, for any engine's listener."""

from __future__ import annotations

import hashlib
import time

import msgspec

from kvwire.protocol.codec import encode_frame
from kvwire.protocol.messages import MAX_FRAME_BYTES, Ack, ErrorCode, GetMetadata, Metadata, Sealed
from kvwire.testing.protocol_conformance.model import Check, Context, Role
from kvwire.testing.protocol_conformance.wire import (
    CheckFailed,
    Silence,
    Target,
    ask,
    describe,
    exchange,
    expect_error,
    fetch_metadata,
    metadata_request,
    now_ms,
    opened,
    raw_frame,
    report,
)

_DTYPES = {"float16", "bfloat16", "float32", "float8"}
MAX_SKEW_S = 30.0
MAX_REQUESTS_PER_CONNECTION = 64
IDLE_TIMEOUT_S = 10.0


def require(ok: bool, why: str) -> None:
    if not ok:
        raise CheckFailed(why)


def documented_compat_hash(md: Metadata) -> str:
    """§5 computed from the reply's own ``compat`` values: SHA-256 (hex) of the msgpack array, with one
    more element, the string ``"kv_fused"``, when the cache is fused, and ``"pull_claims"`` in pull mode."""
    c = md.compat
    assert c is not None
    values: list[object] = ["kvwire/compat", md.version, c.model_id, c.dtype, c.num_layers, c.kv_heads]
    values += [c.head_dim, c.layout, c.mla, c.transfer_mode.value]
    if c.kv_fused:
        values.append("kv_fused")
    if c.transfer_mode.value == "pull":
        values.append("pull_claims")
    return hashlib.sha256(msgspec.msgpack.encode(values)).hexdigest()


def _check_identity(md: Metadata, target: Target) -> None:
    require(md.version == 1, f"version {md.version}, not 1")
    require(bool(md.engine_id) and bool(md.incarnation), "empty engine_id or incarnation")
    want = f"{md.engine_id}/{md.incarnation}/pp{md.pp_rank}/tp{md.tp_rank}"
    require(md.agent_name == want, f"agent_name {md.agent_name!r}, §2 says {want!r}")
    asked = (target.pp_rank, target.tp_rank)
    require((md.pp_rank, md.tp_rank) == asked, f"answered for rank {(md.pp_rank, md.tp_rank)}, asked {asked}")
    require(md.tp_rank < md.tp_size and md.pp_rank < md.pp_size, "rank outside its tp_size/pp_size")


def _check_kv(md: Metadata) -> None:
    kv = md.kv
    require(kv.layout in ("HND", "NHD"), f"layout {kv.layout!r}")
    require(kv.dtype in _DTYPES, f"dtype {kv.dtype!r}")
    require(md.num_blocks >= 1, "num_blocks 0")
    if md.compat is None:
        return
    c = md.compat
    same = (c.dtype, c.kv_heads, c.head_dim, c.layout, c.mla, c.kv_fused)
    require(same == (kv.dtype, kv.kv_heads, kv.head_dim, kv.layout, kv.mla, kv.kv_fused), "compat != kv")
    require(c.num_layers >= kv.first_layer + kv.num_layers, "kv's layers lie outside the model's")
    require(md.compat_hash == documented_compat_hash(md), "compat_hash is not §5's hash of compat")


def _check_regions(md: Metadata) -> None:
    kv = md.kv
    require(bool(md.regions), "a full reply with no regions")
    kinds = {"kv"} if kv.kv_fused or kv.mla else {"k", "v"}  # as KVSpec.kinds: one latent region
    seen: set[tuple[int, str]] = set()
    for r in md.regions:
        require(r.kind in kinds, f"region kind {r.kind!r} (kv_fused={kv.kv_fused})")
        layers = range(kv.first_layer, kv.first_layer + kv.num_layers)
        require(r.layer in layers, f"region of layer {r.layer}, outside {layers}")
        require((r.layer, r.kind) not in seen, f"two regions for layer {r.layer} {r.kind}")
        seen.add((r.layer, r.kind))
    want = {
        (layer, kind) for layer in range(kv.first_layer, kv.first_layer + kv.num_layers) for kind in kinds
    }
    missing = sorted(want - seen)
    require(
        not missing, f"{len(seen)} of {len(want)} regions (one per layer and kind): none for {missing[:4]}"
    )


async def metadata_full(ctx: Context) -> str:
    md = await ctx.metadata()
    _check_identity(md, ctx.target)
    _check_kv(md)
    _check_regions(md)
    if md.compat is None:  # §2: nil by default (older peers); the kit can then neither recompute nor explain
        return f"{md.engine_id} {md.agent_name}, {len(md.regions)} regions; no compat map (allowed, §2)"
    return f"{md.engine_id} {md.agent_name}, {len(md.regions)} regions, compat hash matches §5"


async def metadata_notif_only(ctx: Context) -> str:
    full = await ctx.metadata()
    md = await fetch_metadata(ctx.target, notif_only=True)
    require(md.notif_only and not md.regions, "a notif_only request answered with regions")
    require((md.agent_name, md.incarnation) == (full.agent_name, full.incarnation), "another agent")
    require(len(md.agent_metadata) < len(full.agent_metadata), "connection metadata as large as the full")
    return (
        f"{len(md.agent_metadata)} bytes of connection metadata ({len(full.agent_metadata)} full), no regions"
    )


async def server_time(ctx: Context) -> str:
    before = time.time()
    md = await fetch_metadata(ctx.target, notif_only=True)
    skew = md.server_time - (before + time.time()) / 2
    require(abs(skew) < MAX_SKEW_S, f"server_time {md.server_time!r} is {skew:.3g} s from this clock")
    return f"seconds since the epoch, {skew * 1e3:+.1f} ms from this clock"


async def requests_per_connection(ctx: Context) -> str:
    t = ctx.target
    n = MAX_REQUESTS_PER_CONNECTION + 1
    frames = [encode_frame(metadata_request(t, notif_only=True)) for _ in range(n)]
    answers = await exchange(t, frames, stop_at_silence=True)  # a silent peer: one timeout, not 65
    served = sum(1 for a in answers[: n - 1] if isinstance(a, Metadata | Sealed))
    if served < n - 1:
        raise CheckFailed(f"{served} of the first {n - 1} requests on one connection answered, then "
                          f"{describe(answers[-1])}")  # fmt: skip
    require(answers[-1] is Silence.CLOSED, f"request {n} on one connection: {describe(answers[-1])}")
    return f"{n - 1} answered on one connection, the next one closed"


async def _refused_then_closed(t: Target, frame: bytes, code: ErrorCode) -> str:
    answers = await exchange(t, [frame], then_eof=True)
    seen = expect_error(t, answers[0], None, code)
    require(answers[1] is Silence.CLOSED, f"after the refusal: {describe(answers[1])}, want closed (§1)")
    return seen + ", then closed"


async def oversized_frame(ctx: Context) -> str:
    header = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")  # the body is never sent: refused on the header
    return await _refused_then_closed(ctx.target, header, ErrorCode.BAD_REQUEST)


async def empty_frame(ctx: Context) -> str:
    return await _refused_then_closed(ctx.target, b"\x00\x00\x00\x00", ErrorCode.BAD_REQUEST)


async def not_a_map(ctx: Context) -> str:
    return await _refused_then_closed(ctx.target, raw_frame([1, 2, 3]), ErrorCode.BAD_REQUEST)


async def unknown_type(ctx: Context) -> str:
    frame = raw_frame({"type": "kvwire_conformance_unknown", "version": 1})
    return await _refused_then_closed(ctx.target, frame, ErrorCode.BAD_REQUEST)


async def notification_on_side_channel(ctx: Context) -> str:
    cancel = {"type": "cancel", "version": 1, "transfer_id": "t", "engine_id": "e", "incarnation": "i"}
    return await _refused_then_closed(ctx.target, raw_frame(cancel), ErrorCode.BAD_REQUEST)


async def reply_as_request(ctx: Context) -> str:
    return await _refused_then_closed(ctx.target, encode_frame(Ack()), ErrorCode.BAD_REQUEST)


async def newer_version(ctx: Context) -> str:
    # A field a newer version may have retyped: the version is checked first (§1).
    req = {"type": "get_metadata", "version": 2, "pp_rank": 0, "tp_rank": 0, "notif_only": "retyped"}
    return await _refused_then_closed(ctx.target, raw_frame(req), ErrorCode.INCOMPATIBLE)


async def missing_field(ctx: Context) -> str:
    return await _refused_then_closed(
        ctx.target, raw_frame({"type": "get_metadata", "version": 1, "pp_rank": 0}), ErrorCode.BAD_REQUEST
    )


async def negative_rank(ctx: Context) -> str:
    req = {"type": "get_metadata", "version": 1, "pp_rank": 0, "tp_rank": -1}
    return await _refused_then_closed(ctx.target, raw_frame(req), ErrorCode.BAD_REQUEST)


async def no_such_rank(ctx: Context) -> str:
    t = ctx.target
    req = metadata_request(Target(t.host, t.port, t.secret, t.pp_rank, 4096, t.timeout_s))
    return expect_error(t, await ask(t, req), req, ErrorCode.NO_SUCH_RANK)


async def plain_metadata(ctx: Context) -> str:
    req = metadata_request(ctx.target, notif_only=True)
    answer = await ask(ctx.target, req)
    require(isinstance(answer, Metadata), f"without a secret, want plain metadata, got {describe(answer)}")
    return "plain metadata"


# -- with a secret (§4) -----------------------------------------------------------------------------------


async def _unauthorized(t: Target, req: GetMetadata) -> str:
    return expect_error(t, await ask(t, req), req, ErrorCode.UNAUTHORIZED)


async def auth_unsigned(ctx: Context) -> str:
    t = ctx.target
    return await _unauthorized(t, GetMetadata(pp_rank=t.pp_rank, tp_rank=t.tp_rank, notif_only=True))


async def auth_wrong_secret(ctx: Context) -> str:
    t = ctx.target
    other = Target(t.host, t.port, b"not-" + (t.secret or b""), t.pp_rank, t.tp_rank, t.timeout_s)
    return await _unauthorized(t, metadata_request(other, notif_only=True))


async def auth_other_target(ctx: Context) -> str:
    t = ctx.target
    at = f"{t.host}:{t.port + 1 if t.port < 65535 else t.port - 1}"
    return await _unauthorized(t, metadata_request(t, notif_only=True, at=at))


async def auth_clock_window(ctx: Context) -> str:
    t = ctx.target
    inside = metadata_request(t, notif_only=True, now_ms=now_ms() - 20_000)
    msg, _ = opened(t, await ask(t, inside), inside)
    require(isinstance(msg, Metadata), f"a request made 20 s ago: {describe(msg)}, want metadata")
    seen = await _unauthorized(t, metadata_request(t, notif_only=True, now_ms=now_ms() - 40_000))
    return f"20 s old: metadata; 40 s old: {seen}"


async def auth_replay(ctx: Context) -> str:
    t = ctx.target
    req = metadata_request(t, notif_only=True)
    msg, _ = opened(t, await ask(t, req), req)
    require(isinstance(msg, Metadata), f"first use: {describe(msg)}")
    return "replayed: " + await _unauthorized(t, req)


# -- report_failed (§2) -----------------------------------------------------------------------------------


async def report_refused_by_prefill(ctx: Context) -> str:
    t = ctx.target
    req = report(t, await ctx.metadata())
    return expect_error(t, await ask(t, req), req, ErrorCode.BAD_REQUEST)


async def _acked(ctx: Context, **fields: object) -> str:
    t = ctx.target
    req = report(t, await ctx.metadata(), **fields)
    msg, was_sealed = opened(t, await ask(t, req), req)
    require(isinstance(msg, Ack), f"want ack, got {describe(msg)}")
    require(not was_sealed, "a sealed ack: §4 says the ack goes plain")
    return "ack"


async def report_unknown_transfer(ctx: Context) -> str:
    return await _acked(ctx) + " (the core drops it: a transfer it does not hold)"


async def report_unknown_reason(ctx: Context) -> str:
    return await _acked(ctx, reason="kvwire_conformance_future_reason") + " (taken as reason unknown)"


async def report_other_life(ctx: Context) -> str:
    t = ctx.target
    req = report(t, await ctx.metadata(), to_incarnation="kvwire-conformance-gone")
    return expect_error(t, await ask(t, req), req, ErrorCode.BAD_REQUEST)


async def report_no_such_rank(ctx: Context) -> str:
    t = ctx.target
    req = report(t, await ctx.metadata(), tp_rank=4096)
    return expect_error(t, await ask(t, req), req, ErrorCode.NO_SUCH_RANK)


async def report_unsigned(ctx: Context) -> str:
    t = ctx.target
    unsigned = Target(t.host, t.port, None, t.pp_rank, t.tp_rank, t.timeout_s)
    req = report(unsigned, await ctx.metadata())
    return expect_error(t, await ask(t, req), req, ErrorCode.UNAUTHORIZED)


async def idle_connection_closed(ctx: Context) -> str:
    t = ctx.target
    waiting = Target(t.host, t.port, t.secret, t.pp_rank, t.tp_rank, IDLE_TIMEOUT_S + 5.0)
    start = time.monotonic()
    answer = (await exchange(waiting, [], then_eof=True))[0]
    took = time.monotonic() - start
    require(answer is Silence.CLOSED, f"an idle connection: {describe(answer)}")
    require(took >= IDLE_TIMEOUT_S - 1.0, f"an idle connection closed after {took:.1f} s, before 10 s")
    return f"closed after {took:.1f} s idle"


_P, _D = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
SIDE_CHECKS: tuple[Check, ...] = (
    Check("metadata.full", "§2 metadata, §5", metadata_full),
    Check("metadata.notif_only", "§2 get_metadata notif_only", metadata_notif_only),
    Check("metadata.server_time", "§2 metadata server_time", server_time),
    Check("metadata.plain_without_secret", "§4 replies", plain_metadata, secret=False),
    Check("side.requests_per_connection", "§1 framing: 64 requests", requests_per_connection),
    Check("bad.oversized_frame", "§1 framing: FrameTooLarge", oversized_frame),
    Check("bad.empty_frame", "§1 framing", empty_frame),
    Check("bad.not_a_map", "§1 decoding errors", not_a_map),
    Check("bad.unknown_type", "§1 decoding errors", unknown_type),
    Check("bad.notification_type", "§1 decoding errors", notification_on_side_channel),
    Check("bad.reply_as_request", "§2 error bad_request", reply_as_request),
    Check("bad.newer_version", "§1 VersionMismatch", newer_version),
    Check("bad.missing_field", "§1 decoding errors", missing_field),
    Check("bad.negative_rank", "§1 value constraints", negative_rank),
    Check("error.no_such_rank", "§2 error", no_such_rank),
    Check("auth.unsigned", "§4", auth_unsigned, secret=True),
    Check("auth.wrong_secret", "§4", auth_wrong_secret, secret=True),
    Check("auth.other_target", "§4 target binding", auth_other_target, secret=True),
    Check("auth.clock_window", "§4 ts_ms within 30 s", auth_clock_window, secret=True),
    Check("auth.replay", "§4 replay guard", auth_replay, secret=True),
    Check("report.refused_by_prefill", "§2 report_failed", report_refused_by_prefill, roles=_P),
    Check("report.unknown_transfer", "§2 report_failed", report_unknown_transfer, roles=_D),
    Check("report.unknown_reason", "§3 reason unknown", report_unknown_reason, roles=_D),
    Check("report.other_life", "§2 report_failed", report_other_life, roles=_D),
    Check("report.no_such_rank", "§2 report_failed", report_no_such_rank, roles=_D),
    Check("report.unsigned", "§4", report_unsigned, roles=_D, secret=True),
    Check("side.idle_timeout", "§1 framing: idle 10 s", idle_connection_closed, slow=True),
)
