"""Simulated engines: the real cores, real ``KVCache`` memory, a block allocator, and a driver that turns
the cores' actions into simulated I/O (``World``) under the cores' contract (``kvwire.core.io``)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

import numpy as np

from kvwire.connector.reports import as_notification, report_of
from kvwire.connector.sidecalls import CLAIM_REFUSALS
from kvwire.core.base import CoreBase, Feeder, Refused
from kvwire.core.config import ConnectorConfig
from kvwire.core.io import (
    Action,
    AnswerClaim,
    ClaimAnswered,
    ClaimArrived,
    Digest,
    Digested,
    Emit,
    ForgetPeer,
    Input,
    NotifIn,
    Outcome,
    PostRead,
    PostWrite,
    Reap,
    Release,
    ReportFailure,
    Send,
    SendClaim,
    StartHandshake,
    Tick,
    TouchPeer,
    XferEnded,
)
from kvwire.core.producer import ProducerCore
from kvwire.handshake.types import EngineInfo
from kvwire.kv.cache import KVCache
from kvwire.kv.digest import kv_digest
from kvwire.kv.mapping import RankLayout, layer_window
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import CancelAck, Claim, Done, ErrorCode, Failed, FailReason, TransferMode
from kvwire.protocol.ranks import RankKey
from kvwire.testing.sim.handshakes import SimHandshakes
from kvwire.testing.sim.net import Region, World, metered
from kvwire.transport.base import make_agent_name

CoreFactory = Callable[[EngineInfo, dict[RankKey, RankLayout], int, ConnectorConfig, str], CoreBase]


@dataclass
class _Xfer:
    """One posted transfer: ``src`` rows are copied to ``dst`` rows (a WRITE's ``dst`` and a READ's ``dst``
    are both D's memory: the C1 check looks there)."""

    token: int
    remote: SimEngine  # the peer engine (its life at post time)
    peer_agent: str
    sender_agent: str  # the posting rank's agent: a WRITE's notification comes from it
    src: np.ndarray
    dst: np.ndarray
    notif: bytes | None
    transfer_id: str
    released: bool = False
    ended: bool = False


class SimEngine:
    """One engine (all its ranks) across its lives: a crash starts a new incarnation at the same address,
    under the same engine id or (as kvwire serve and vLLM do by default) a new one, ``wire_id``;
    ``engine_id`` stays the simulator's name for the engine (partitions, reports)."""

    def __init__(
        self,
        world: World,
        engine_id: str,
        port: int,
        spec: KVSpec,
        *,
        tp: int,
        pp: int,
        num_blocks: int,
        mode: TransferMode,
        config: ConnectorConfig,
        make_core: CoreFactory,
        on_event: Callable[[SimEngine, object], None],
    ) -> None:
        self.world, self.engine_id, self.port, self.spec = world, engine_id, port, spec
        self.tp, self.pp, self.num_blocks, self.mode, self.config = tp, pp, num_blocks, mode, config
        self._make_core, self._on_event = make_core, on_event
        self.life = 0
        self.wire_id = engine_id
        self.claim_verdicts: dict[int, AnswerClaim] = {}  # P: its core's answer to the claim being judged
        self._claim_token = 0
        self.expired = 0  # D: quarantines the lives before this one released at the bound
        self.graveyard: list[KVCache] = []  # old lives' memory stays mapped: late writes must not crash us
        self._start_life()

    # -- lives -------------------------------------------------------------------------------------------
    def _start_life(self) -> None:
        w = self.world
        self.life += 1
        self.incarnation = f"{self.wire_id}-life{self.life}"
        self.info = EngineInfo(self.wire_id, self.incarnation, "sim", self.spec, self.tp, self.pp, self.mode)
        self.caches: dict[RankKey, KVCache] = {}
        self.agent_names: dict[RankKey, str] = {}
        for p in range(self.pp):
            window = layer_window(self.spec.num_layers, self.pp, p)
            for t in range(self.tp):
                cache = KVCache(
                    self.spec, self.num_blocks, tp_size=self.tp, tp_rank=t,
                    first_layer=window.start, num_layers=len(window),
                )  # fmt: skip
                self.caches[(p, t)] = cache
                name = make_agent_name(self.wire_id, self.incarnation, p, t)
                self.agent_names[(p, t)] = name
                w.agents[name] = self
                for r in cache.regions():
                    w.memory.add(Region(r.base_addr, r.block_len, r.num_blocks), self)
        self.layouts = {
            key: RankLayout.from_cache(c, pp_size=self.pp, pp_rank=key[0]) for key, c in self.caches.items()
        }
        self.core = self._make_core(self.info, self.layouts, self.num_blocks, self.config, "sim")
        self.core.port = self.port
        if w.meter_cores:  # an instance attribute shadows the method, for this life's core only
            setattr(self.core, "handle", metered(w, self.core.handle))  # noqa: B010 (mypy: method assign)
        # P in push mode: it ends each registration with one notification (the one-ending check).
        self.is_producer = self.mode is TransferMode.PUSH and isinstance(self.core, ProducerCore)
        w.addresses[("sim", self.port)] = self
        self.free: list[int] = list(range(self.num_blocks))
        self.owner: dict[int, str] = {}  # block -> transfer id that holds it
        self.writable: set[str] = set()  # D: transfers whose blocks a peer may write now
        # The remote agents each local agent has loaded (what the handshake cores load and unload).
        self.loaded: dict[RankKey, set[str]] = {key: set() for key in self.caches}
        self.handshakes = SimHandshakes(self)  # the real handshake core per local rank
        self.xfers: dict[int, _Xfer] = {}
        self.paused_until = 0.0
        self.deferred: collections.deque[Input] = collections.deque()
        self.alive = True
        self._tick_at = math.inf
        self._feeder = Feeder(self.core, self._execute, self._failed)

    def crash(self, new_id: bool = False) -> None:
        """The process dies: every agent, transfer and request of this life is gone; restart at once,
        under a new engine id with ``new_id``."""
        w = self.world
        self.expired = self.quarantines_expired()
        if new_id:
            self.wire_id = f"{self.engine_id}.{self.life + 1}"
        for name in self.agent_names.values():
            w.agents.pop(name, None)
        w.memory.remove(self)
        self.graveyard.extend(self.caches.values())
        self.alive = False
        for x in self.xfers.values():
            x.released = True
        self._start_life()

    def quarantines_expired(self) -> int:
        """D: dead P lives' blocks released at the quarantine bound, never confirmed, over all its lives."""
        return self.expired + self.core.stats.quarantine_expired

    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.world.now + seconds)
        self.world.at(self.paused_until, self._resume)

    @property
    def paused(self) -> bool:
        return self.world.now < self.paused_until

    def _resume(self) -> None:
        if self.paused:
            return
        # A thawed process's loop runs its timers first (kvwire's driver ticks before it progresses).
        self.feed(Tick())
        while self.deferred and not self.paused:
            self.feed(self.deferred.popleft())

    # -- inputs --------------------------------------------------------------------------------------------
    def feed(self, inp: Input) -> None:
        if self.paused:
            if not isinstance(inp, Tick):  # a frozen process does not tick: its thaw does, once
                self.deferred.append(inp)
            return
        self._feeder.feed(self.world.now, inp)
        self._schedule_tick()

    def follow(self, inp: Input) -> None:
        """Handle ``inp`` right after the current input (an action's answer: ``Feeder.follow``)."""
        self._feeder.follow(inp)

    def _failed(self, item: Input, exc: Exception) -> None:
        if not isinstance(exc, Refused):  # anything else escaping a core (or an action) is a bug
            self.world.violation(f"{self.engine_id}: {type(item).__name__} raised {exc!r}")

    def notif_in(self, agent: str, sender: str, raw: bytes) -> None:
        key = next(k for k, n in self.agent_names.items() if n == agent)
        self.feed(NotifIn(key, sender, raw))

    def _schedule_tick(self) -> None:
        at = self.core.wake_at()
        if at < self._tick_at:
            self._tick_at = at
            life = self.life
            self.world.at(at, lambda: self._tick(life, at))

    def _tick(self, life: int, at: float) -> None:
        if life != self.life or at != self._tick_at:
            return  # superseded by an earlier tick, or of a dead life
        self._tick_at = math.inf
        self.feed(Tick())

    # -- actions -------------------------------------------------------------------------------------------
    def _execute(self, action: Action) -> None:
        match action:
            case Send():
                ok = self._send(action)
                if action.token:
                    self._feeder.follow(Outcome(action.token, ok))
            case PostWrite() | PostRead():
                self._post(action)
            case Digest(token, key, scope):
                self._feeder.follow(Digested(token, kv_digest(self.caches[key], scope)))
            case Release(token):
                x = self.xfers.pop(token, None)
                if x is not None:
                    self._release(x)
            case StartHandshake():
                self.handshakes.start(action)
            case ReportFailure():
                self._report(action)
            case ForgetPeer(engine_id, incarnation):
                self.handshakes.forget(engine_id, incarnation)
            case TouchPeer(engine_id):
                self.handshakes.touch(engine_id)
            case Reap(in_use):
                self.core.stats.peers_reaped += self.handshakes.reap(in_use)
            case Emit(event):
                self._on_event(self, event)
            case SendClaim():
                self._claim(action)
            case AnswerClaim():
                self.claim_verdicts[action.token] = action
            case _:
                assert_never(action)

    def _peer_engine(self, key: RankKey, peer: str) -> SimEngine | None:
        if peer not in self.loaded[key]:
            return None
        return self.world.agents.get(peer)

    def _send(self, action: Send) -> bool:
        dst = self._peer_engine(action.key, action.peer)
        if dst is None:
            if action.peer in self.loaded[action.key]:
                # Loaded, but its process is gone: the transport says so (PeerDisconnected), and the driver
                # has the handshake cores forget that life (``ConnectorBase._forget_agent``).
                self.handshakes.forget_agent(action.peer)
            return False
        sender = self.agent_names[action.key]
        if self.is_producer and isinstance(action.msg, Done | Failed | CancelAck):
            self.world.ending_sent(sender, action.peer, action.msg.transfer_id, type(action.msg).__name__)
        self.world.deliver(self, action.peer, encode_notif(action.msg), sender)
        return True

    def _post(self, action: PostWrite | PostRead) -> None:
        w, f = self.world, self.world.faults
        dst = self._peer_engine(action.key, action.peer)
        if dst is None or w.chance(f.failed_post, "failed_post"):
            self._feeder.follow(Outcome(action.token, False, "post refused"))
            return
        x = _Xfer(
            action.token,
            dst,
            action.peer,
            self.agent_names[action.key],
            action.src,
            action.dst,
            action.notif if isinstance(action, PostWrite) else None,
            action.transfer_id,
        )
        self.xfers[action.token] = x
        self._feeder.follow(Outcome(action.token, True))
        duration = 50e-6 + w.rng.random() * 200e-6
        if w.chance(f.slow_write, "slow_write"):
            duration += w.rng.random() * f.slow_write_max_s
        if w.chance(f.stuck_write, "stuck_write"):
            return  # never lands: the core's transfer timeout releases it
        fail = w.chance(f.failed_write, "failed_write")
        w.after(duration, lambda: self._land(x, fail))

    def _land(self, x: _Xfer, fail: bool) -> None:
        w = self.world
        if x.released or x.ended or not self.alive:
            return
        if self.paused:  # no progress while frozen: it lands after the thaw, unless recalled first
            w.at(self.paused_until, lambda: self._land(x, fail))
            return
        healed = w.partitions.get(frozenset((self.engine_id, x.remote.engine_id)), 0.0)
        if healed > w.now:  # UCX retries until the link comes back
            w.at(healed, lambda: self._land(x, fail))
            return
        if fail or w.agents.get(x.peer_agent) is not x.remote or not x.remote.alive:
            x.ended = True
            self.feed(XferEnded(x.token, False, "write failed" if fail else "peer gone"))
            return
        self._check_landing(x.transfer_id, x.dst)
        self._check_source(x.transfer_id, x.src)
        w.copy(x.src, x.dst)
        x.ended = True
        if x.notif is not None:
            if self.is_producer:  # a WRITE's notification is its done
                w.ending_sent(x.sender_agent, x.peer_agent, x.transfer_id, "done (with the write)")
            w.deliver(self, x.peer_agent, x.notif, x.sender_agent)
        self.feed(XferEnded(x.token, True))

    def _release(self, x: _Xfer) -> None:
        """Cancel a transfer; one still in flight may land a prefix of its rows as it is cancelled, or
        later (``release_drain_max_s``: a drain time, and for P's writes after the partition if one cuts
        the pair). A read D releases during a partition lands nothing, as before: whether UCX completes
        it after the heal is not known here (docs/reliability.md)."""
        w = self.world
        in_flight = not x.ended and not x.released
        x.released = True
        drain_max = w.faults.release_drain_max_s
        cut = w.partitioned(self.engine_id, x.remote.engine_id)
        if not in_flight or (cut and not (drain_max and self.is_producer)):
            return
        if w.agents.get(x.peer_agent) is not x.remote or not w.chance(
            w.faults.release_lands, "release_lands"
        ):
            return
        rows = w.rng.randint(1, len(x.src))
        if not drain_max:
            self._drained(x, rows)
            return
        healed = w.partitions.get(frozenset((self.engine_id, x.remote.engine_id)), 0.0)
        w.after(max(0.0, healed - w.now) + w.rng.random() * drain_max, lambda: self._drained(x, rows))

    def _drained(self, x: _Xfer, rows: int) -> None:
        """The first ``rows`` rows of a released write land (in the peer's memory, if its life lasts)."""
        w = self.world
        if w.agents.get(x.peer_agent) is not x.remote or not x.remote.alive:
            return
        self._check_landing(x.transfer_id, x.dst[:rows])
        w.copy(x.src[:rows], x.dst[:rows])

    def _check_landing(self, tid: str, rows: np.ndarray) -> None:
        """C1: every destination block must be registered to this transfer, in the receiving life, now."""
        w = self.world
        checked: set[tuple[int, int, int]] = set()  # (engine, first, last) spans found fine: every region
        for (engine, first, last), (addr, length, _) in zip(w.memory.spans(rows), rows.tolist(), strict=True):
            if engine is None:
                w.violation(f"write outside any live cache at {addr:#x}+{length}")
                continue
            span = (id(engine), first, last)
            if span in checked:
                continue
            for b in range(first, last + 1):
                owner = engine.owner.get(b)
                if owner != tid or tid not in engine.writable:
                    what = "a free block" if owner is None else f"a block of {owner}"
                    state = "" if owner != tid else " (no longer writable)"
                    w.violation(f"C1: {tid}'s bytes landed in {engine.engine_id} {what}{state}")
                    return
            checked.add(span)

    def _check_source(self, tid: str, rows: np.ndarray) -> None:
        """S1: every source block (P's, of a push write or a pull read) must still be held for this transfer
        when the copy completes: P's engine may reuse a block it freed (a layer-wise write after the step,
        a write after the freeable event). A released transfer's drain is not checked: it only lands in
        blocks D holds back (C1), whatever it read."""
        w = self.world
        for engine, first, last in set(w.memory.spans(rows)):
            if engine is None:
                w.violation(f"S1: {tid} copied from outside any live cache")
                return
            owner = engine.owner
            if any(owner.get(b) != tid for b in range(first, last + 1)):
                w.violation(
                    f"S1: {tid}'s bytes were read from {engine.engine_id} blocks no longer held for it"
                )
                return

    def _claim(self, a: SendClaim) -> None:
        """A ``claim`` on P's side channel: judged by P's core when it arrives (a frozen, dead or cut-off
        P answers nothing: the claim times out), answered back after another hop."""
        w, life = self.world, self.life
        target = w.addresses.get((a.host, a.port))
        hop = 200e-6 + w.rng.random() * 800e-6

        def answer(got: ClaimAnswered) -> None:
            if self.life == life and self.alive:
                self.feed(got)

        def judge() -> None:
            if (
                target is None
                or not target.alive
                or target.paused
                or w.partitioned(self.engine_id, target.engine_id)
            ):
                timeout = self.config.handshake_timeout_s - hop
                w.after(timeout, lambda: answer(ClaimAnswered(a.token, None, FailReason.HANDSHAKE_FAILED)))
                return
            lease_s, refusal = target.judge_claim(a.claim)
            w.after(hop, lambda: answer(ClaimAnswered(a.token, lease_s, refusal)))

        w.after(hop, judge)

    def judge_claim(self, claim: Claim) -> tuple[float | None, FailReason | None]:
        """This engine's side channel taking a claim (as ``SideChannelServer.claim``): its core says."""
        if claim.to_incarnation != self.incarnation or not isinstance(self.core, ProducerCore):
            return None, FailReason.LEASE_EXPIRED
        self._claim_token += 1
        self.feed(ClaimArrived(self._claim_token, claim))
        verdict = self.claim_verdicts.pop(self._claim_token, None)
        if verdict is not None and verdict.lease_s is not None:
            return verdict.lease_s, None
        code = verdict.code if verdict is not None else ErrorCode.GONE
        return None, CLAIM_REFUSALS.get(code or ErrorCode.GONE, FailReason.HANDSHAKE_FAILED)

    def _report(self, a: ReportFailure) -> None:
        """A ``report_failed`` on the peer's side channel: lost when nobody listens there or the link is
        cut (one attempt, as the driver makes); else it arrives as the ``failed`` it stands for."""
        w = self.world
        target = w.addresses.get((a.host, a.port))
        if target is None or w.partitioned(self.engine_id, target.engine_id) or a.remote not in target.caches:
            return
        inp, tlife = as_notification(report_of(a)), target.life
        agent = target.agent_names[a.remote]
        w.after(200e-6 + w.rng.random() * 800e-6, lambda: self._report_arrives(target, tlife, agent, inp))

    @staticmethod
    def _report_arrives(target: SimEngine, tlife: int, agent: str, inp: NotifIn) -> None:
        if target.life == tlife and target.alive:
            target.notif_in(agent, inp.sender, inp.raw)

    # -- blocks --------------------------------------------------------------------------------------------
    def allocate(self, tid: str, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        # The engine reuses the most recently freed blocks first: a late write finds them taken at once.
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.owner[b] = tid
        return blocks

    def release(self, tid: str, blocks: list[int]) -> None:
        for b in blocks:
            if self.owner.get(b) != tid:
                self.world.violation(f"{self.engine_id}: block {b} freed twice or by {tid}, not its owner")
                continue
            del self.owner[b]
            self.free.append(b)
