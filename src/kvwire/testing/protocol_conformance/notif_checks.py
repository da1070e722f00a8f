"""Checks over notifications (docs/protocol.md §3, §4), against a prefill engine in push mode.

The kit plays a decode engine of its own: one NIXL agent (progress thread off, named as §2 says), a small
registered cache whose geometry and compat values it copies from the target's metadata, and its own side
channel, which P dials for its full handshake (signed for the kit's address under a secret). From there it
sends ``push_reg``/``cancel`` for transfers P never prefills and checks P's answers and their timing:
exactly one ending message per registration, the fence, and a ``report_failed`` on the kit's side channel
when P finds the kit incompatible. Notifications are sealed and checked as §4 says under a secret.

Each ``push_reg`` carries a fresh non-zero ``reg_nonce``, as §3 says D's do. P's fail-closed rules that
need its prefill (``failed``/``short_registration`` for a push_reg that does not cover the prompt, a
``done`` that echoes ``reg_nonce`` and states ``nbytes``) are not checked: P decides them when its prefill
of the transfer ends, and the kit, speaking only to the side channel and NIXL, cannot make P prefill
anything (that takes P's serving API). A ``done`` that reaches the kit all the same is held to them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.errors import AuthError, KvwireError, ProtocolError
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import LocalRank
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    Metadata,
    Notification,
    PushReg,
    ReportFailed,
    TransferMode,
)
from kvwire.protocol.seal import NotifGate
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.testing.protocol_conformance.model import Check, Context, Role, Skipped
from kvwire.testing.protocol_conformance.wire import CheckFailed, fetch_metadata, new_nonce

KIT_ENGINE = "kvwire-conformance"
MD_HEADER = b"KVWN\x01"  # then b"F" (full) or b"C" (connection only), then NIXL's bytes (§2)
KIT_BLOCKS = 8
_POLL_S = 0.002
_HEARTBEAT_S = 0.5  # well inside any liveness timeout: P must not call the kit dead mid-check
QUIET_S = 1.0  # how long the kit listens for a second ending message, or for a dropped message's answer
BEAT_WAIT_S = 2.5  # how long the kit waits for a heartbeat P owes every 1 s (§3 Liveness): two and a half
BEAT_GAP_S = 1.5  # the most two of P's heartbeats may be apart, timers' and polling's lateness included
Ending = Done | Failed | CancelAck


@dataclass
class Arrival:
    at: float
    msg: Notification


@dataclass
class KitDecode:
    """The kit's own D: an agent, a cache, a side channel; what P sends it, verified and decoded."""

    rank: LocalRank
    server: SideChannelServer
    host: str  # the address the kit listens on: what the push_reg names, what P must dial
    gate: NotifGate
    p: Metadata
    inbox: list[Arrival] = field(default_factory=list)
    reports: list[ReportFailed] = field(default_factory=list)
    live: set[str] = field(default_factory=set)  # transfers P may hold for the kit (heartbeats name them)
    nonces: dict[str, int] = field(default_factory=dict)  # each push_reg's reg_nonce, by transfer
    bad: list[str] = field(default_factory=list)  # what P sent that does not verify or decode
    _beat_at: float = 0.0

    @property
    def name(self) -> str:
        return self.rank.agent.name

    def push_reg(self, tid: str, *, fence_ms: int = 30_000) -> None:
        kv, info = self.p.kv, self.server.engine
        reg = PushReg(
            transfer_id=tid,
            engine_id=info.engine_id,
            incarnation=info.incarnation,
            tp_rank=0,
            tp_size=1,
            host=self.host,
            port=self.server.port,
            block_ids=[0, 1],
            num_tokens=2 * kv.block_size,
            fence_ms=fence_ms,
            reg_nonce=_reg_nonce(),
        )
        self.nonces[tid] = reg.reg_nonce
        self.live.add(tid)
        self.send(reg)

    def send(self, msg: Notification) -> None:
        self.send_bytes(self.gate.outgoing(self.name, self.p.agent_name, encode_notif(msg)))

    def send_bytes(self, data: bytes) -> None:
        self.rank.agent.send_notif(self.p.agent_name, data)

    def cancel(self, tid: str) -> Cancel:
        info = self.server.engine
        return Cancel(transfer_id=tid, engine_id=info.engine_id, incarnation=info.incarnation)

    def _poll(self) -> None:
        for sender, msgs in self.rank.agent.drain_notifs().items():
            for data in msgs:
                try:
                    msg = decode_notif(self.gate.incoming(sender, self.name, data))
                except (AuthError, ProtocolError) as exc:
                    self.bad.append(f"from {sender}: {exc}")
                    continue
                self.inbox.append(Arrival(time.monotonic(), msg))
        now = time.monotonic()
        if self.live and now - self._beat_at >= _HEARTBEAT_S:
            self._beat_at = now
            info = self.server.engine
            beat = Heartbeat(
                transfer_id="",
                engine_id=info.engine_id,
                incarnation=info.incarnation,
                transfer_ids=[*self.live],
            )
            self.send(beat)

    async def wait(self, until: float, done: Callable[[], bool] | None = None) -> None:
        """Poll (and heartbeat) until the monotonic time ``until``, or until ``done()`` is true."""
        while time.monotonic() < until:
            self._poll()
            if done is not None and done():
                return
            await asyncio.sleep(_POLL_S)

    def endings(self, tid: str) -> list[Arrival]:
        return [a for a in self.inbox if isinstance(a.msg, Ending) and a.msg.transfer_id == tid]

    async def close(self) -> None:
        await self.server.close()
        self.rank.agent.close()


def _spec(md: Metadata) -> KVSpec:
    c = md.compat
    if c is None:
        raise Skipped("the target sends no compat map: the kit cannot build a compatible D")
    layout = Layout(c.layout)
    return KVSpec(c.num_layers, c.kv_heads, c.head_dim, c.dtype, md.kv.block_size, layout, c.mla, c.kv_fused)


async def start_kit(ctx: Context, *, model_suffix: str = "") -> KitDecode:
    """A kit D compatible with the target (or, with ``model_suffix``, not), loaded into the target's
    agent's peers by the kit's own agent (so P's notifications can reach it)."""
    from kvwire.transport.nixl import NixlAgent

    md = await ctx.metadata()
    if md.compat is not None and md.compat.transfer_mode is not TransferMode.PUSH:
        raise Skipped("the target runs in pull mode: P takes no push_reg")
    spec = _spec(md)
    model_id = (md.compat.model_id if md.compat else "") + model_suffix
    try:
        info, ranks = build_registered_engine(KIT_ENGINE, spec, KIT_BLOCKS, NixlAgent, model_id=model_id)
    except KvwireError as exc:
        raise Skipped(f"no NIXL agent here: {exc}") from None
    server = SideChannelServer(info, ranks, host=ctx.listen_host, secret=ctx.target.secret)
    kit = KitDecode(ranks[0], server, ctx.listen_host, NotifGate(ctx.target.secret), md)
    server.on_report = kit.reports.append
    ctx.closers.append(kit.close)
    await server.start()
    conn = await fetch_metadata(ctx.target, notif_only=True)
    loaded = kit.rank.agent.add_peer(conn.agent_metadata)
    if loaded != md.agent_name:
        raise CheckFailed(f"the agent metadata loads as {loaded!r}, the reply names {md.agent_name!r}")
    return kit


async def _kit(ctx: Context) -> KitDecode:
    kit = ctx.shared.get("kit")
    if kit is None:
        kit = ctx.shared["kit"] = await start_kit(ctx)
    assert isinstance(kit, KitDecode)
    return kit


def _reg_nonce() -> int:
    """Non-zero (§3: D never gives 0) and below 2**63, so any msgpack decoder takes it as an int."""
    return int.from_bytes(new_nonce()[:8], "big") >> 1 or 1


def _tid() -> str:
    return f"kvwire-conformance-{new_nonce().hex()}"


def _check_from_p(kit: KitDecode, msg: Notification) -> None:
    p = kit.p
    if (msg.engine_id, msg.incarnation) != (p.engine_id, p.incarnation):
        raise CheckFailed(f"{type(msg).__name__} names {msg.engine_id}/{msg.incarnation}, not the target")
    if isinstance(msg, Ending) and (msg.pp_rank, msg.tp_rank) != (p.pp_rank, p.tp_rank):
        raise CheckFailed(f"{type(msg).__name__} from rank {(msg.pp_rank, msg.tp_rank)}, not the target's")
    if isinstance(msg, Done) and (msg.reg_nonce != kit.nonces.get(msg.transfer_id) or msg.nbytes is None):
        raise CheckFailed(f"done {msg}: §3 wants the push_reg's reg_nonce echoed and nbytes stated")


async def push_reg_handshake(ctx: Context) -> str:
    kit = await _kit(ctx)
    tid = ctx.shared["held"] = _tid()
    start = time.monotonic()
    kit.push_reg(tid)
    await kit.wait(start + ctx.target.timeout_s, lambda: kit.server.stats.replies["metadata"] >= 1)
    if kit.server.stats.replies["metadata"] < 1:
        raise CheckFailed(f"no full get_metadata at the push_reg's address within {ctx.target.timeout_s} s")
    signed = " (signed for the kit's address)" if ctx.target.secret else ""
    return (
        f"P fetched the kit's full metadata{signed} {1e3 * (time.monotonic() - start):.0f} ms after push_reg"
    )


def _beats(kit: KitDecode, tid: str, after: float = 0.0) -> list[Arrival]:
    """P's heartbeats naming ``tid`` that arrived after the monotonic time ``after``."""
    return [
        a for a in kit.inbox if isinstance(a.msg, Heartbeat) and tid in a.msg.transfer_ids and a.at > after
    ]


async def heartbeats_name_what_p_holds(ctx: Context) -> str:
    kit = await _kit(ctx)
    tid = str(ctx.shared.get("held", ""))
    if not tid or kit.endings(tid):  # nothing held (an earlier check failed, or P ended it): not this rule's
        raise Skipped("P holds no registration for the kit: see notif.push_reg_handshake and the auth checks")
    start = time.monotonic()
    await kit.wait(start + 2 * BEAT_WAIT_S, lambda: len(_beats(kit, tid, after=start)) >= 2)
    beats = _beats(kit, tid, after=start)
    if len(beats) < 2:
        raise CheckFailed(
            f"{len(beats)} heartbeats naming the held registration {tid} in {2 * BEAT_WAIT_S:.0f} s: §3 "
            "Liveness wants one at least every 1 s naming every transfer held (without them D declares P "
            "dead at 5 s)"
        )
    _check_from_p(kit, beats[0].msg)
    gap = beats[1].at - beats[0].at
    if gap > BEAT_GAP_S:
        raise CheckFailed(f"heartbeats naming the held registration {gap:.2f} s apart: §3 wants at most 1 s")
    return f"heartbeats naming the held registration, {gap:.2f} s apart"


async def unauthenticated_dropped(ctx: Context) -> str:
    kit = await _kit(ctx)
    tid = str(ctx.shared.get("held", ""))
    plain = encode_notif(kit.cancel(tid))
    kit.send_bytes(plain)  # not sealed
    kit.send_bytes(NotifGate(b"kvwire-conformance-wrong-secret").outgoing(kit.name, kit.p.agent_name, plain))
    await kit.wait(time.monotonic() + QUIET_S)
    if kit.endings(tid):
        raise CheckFailed(f"P answered an unauthenticated cancel: {kit.endings(tid)[0].msg}")
    return f"an unsealed and a wrongly tagged cancel: no answer in {QUIET_S:.0f} s"


async def cancel_acked_once(ctx: Context) -> str:
    kit = await _kit(ctx)
    tid = str(ctx.shared.get("held", ""))
    if kit.endings(tid):  # P ended it already (an unsealed cancel it should have dropped): no fresh answer
        raise Skipped(f"the held registration ended before this check's cancel: {kit.endings(tid)[0].msg}")
    start = time.monotonic()
    kit.send(kit.cancel(tid))
    await kit.wait(start + ctx.target.timeout_s, lambda: bool(kit.endings(tid)))
    kit.live.discard(tid)
    await kit.wait(time.monotonic() + BEAT_WAIT_S)  # long enough to hear a heartbeat P still sends
    ends = kit.endings(tid)
    if not ends:
        raise CheckFailed(f"no cancel_ack within {ctx.target.timeout_s} s")
    if _beats(kit, tid, after=ends[0].at):
        raise CheckFailed(f"P still names {tid} in a heartbeat after its ending message: it holds it still")
    first = ends[0].msg
    _check_from_p(kit, first)
    if not isinstance(first, CancelAck) or first.wrote:
        raise CheckFailed(f"a cancel of a registration P never wrote: {first}, want cancel_ack wrote=false")
    if len(ends) > 1:
        raise CheckFailed(f"{len(ends)} ending messages for one registration: {[a.msg for a in ends]}")
    return f"one cancel_ack(wrote=false) {1e3 * (ends[0].at - start):.0f} ms after cancel, nothing after"


async def fence_expired(ctx: Context) -> str:
    kit = await _kit(ctx)
    tid, fence_s = _tid(), 1.0
    start = time.monotonic()
    kit.push_reg(tid, fence_ms=int(fence_s * 1000))
    await kit.wait(start + fence_s + ctx.target.timeout_s, lambda: bool(kit.endings(tid)))
    kit.live.discard(tid)
    ends = kit.endings(tid)
    if not ends:
        raise CheckFailed(
            f"no failed within {fence_s + ctx.target.timeout_s:.0f} s of a {fence_s:.0f} s fence"
        )
    took, first = ends[0].at - start, ends[0].msg
    _check_from_p(kit, first)
    if not isinstance(first, Failed) or first.reason is not FailReason.FENCE_EXPIRED:
        raise CheckFailed(f"want failed/fence_expired, got {first}")
    if took < fence_s - 0.05:
        raise CheckFailed(f"fence_expired {took:.2f} s after the push_reg, before its {fence_s:.0f} s fence")
    return f"failed/fence_expired {took:.2f} s after a push_reg with a {fence_s:.0f} s fence"


async def report_when_incompatible(ctx: Context) -> str:
    kit = await start_kit(ctx, model_suffix="/kvwire-conformance-mismatch")
    tid = _tid()
    start = time.monotonic()
    kit.push_reg(tid)
    await kit.wait(start + 2 * ctx.target.timeout_s, lambda: any(r.transfer_id == tid for r in kit.reports))
    mine = [r for r in kit.reports if r.transfer_id == tid]
    if not mine:
        raise CheckFailed("P found the kit incompatible and sent no report_failed to the push_reg's address")
    r, p = mine[0], kit.p
    want = (kit.server.engine.incarnation, p.engine_id, p.incarnation, FailReason.INCOMPATIBLE)
    got = (r.to_incarnation, r.engine_id, r.incarnation, r.fail_reason)
    if got != want:
        raise CheckFailed(f"report_failed {got}, want {want}")
    return f"report_failed/incompatible {1e3 * (time.monotonic() - start):.0f} ms after push_reg"


async def full_load(ctx: Context) -> str:
    """The full handshake's last step: the full metadata loads into a NIXL agent as the agent it names."""
    from kvwire.transport.nixl import NixlAgent

    md = await ctx.metadata()
    conn = await fetch_metadata(ctx.target, notif_only=True)
    for what, data, tag in (("full", md.agent_metadata, b"F"), ("notif_only", conn.agent_metadata, b"C")):
        if data[:6] != MD_HEADER + tag:
            raise CheckFailed(f"{what} agent_metadata starts {data[:6]!r}, §2 says {MD_HEADER + tag!r}")
    try:
        agent = NixlAgent(f"{KIT_ENGINE}/{new_nonce().hex()}/pp0/tp0")
    except KvwireError as exc:
        raise Skipped(f"no NIXL agent here: {exc}") from None
    try:
        loaded = agent.add_peer(md.agent_metadata)
    except KvwireError as exc:
        raise CheckFailed(f"the full agent_metadata does not load: {exc}") from None
    finally:
        agent.close()
    if loaded != md.agent_name:
        raise CheckFailed(f"the full agent_metadata loads as {loaded!r}, the reply names {md.agent_name!r}")
    return f"headers F and C; the full metadata loads as {loaded}"


_P = frozenset({Role.PREFILL})
NOTIF_CHECKS: tuple[Check, ...] = (
    Check("handshake.full_load", "§2 metadata agent_metadata", full_load),
    Check("notif.push_reg_handshake", "§3 push_reg, §4", push_reg_handshake, roles=_P),
    Check(
        "notif.unauthenticated_dropped", "§4 notifications", unauthenticated_dropped, roles=_P, secret=True
    ),
    Check("notif.heartbeats", "§3 Liveness: heartbeats", heartbeats_name_what_p_holds, roles=_P),
    Check("notif.cancel_acked_once", "§3 rules: one ending message", cancel_acked_once, roles=_P),
    Check("notif.fence_expired", "§3 rules: fence_ms", fence_expired, roles=_P),
    Check("notif.report_when_incompatible", "§2 report_failed", report_when_incompatible, roles=_P),
)
