"""The thin driver both sides share: it turns I/O into core inputs and core actions into I/O.

Every protocol rule lives in a core (``kvwire.core``: ``(now, input) -> actions``); this module owns only
the threads, the side-channel server, the handshake managers, the agents and the clock.

Threading. Every call on an agent, on a handshake manager and on the connector's request state happens
on ONE thread: the background asyncio loop's. The engine's call sites (``request_finished``,
``request_allocated``, ``abort``) only schedule work there (``call_soon_threadsafe``) and return at once;
``poll`` only pops events from a queue. So the engine thread never waits on the network, and neither the
agents (NIXL's Python layer is not thread-safe) nor the state need locks.

The loop runs a ticker: progress every agent, drain and dispatch its notifications, poll posted transfers,
and every few milliseconds check the timers (fences, leases, liveness, heartbeats, idle peers). It ticks
every ``poll_interval_s`` while transfers are live and for a few ticks after any activity (a peer's answer
usually follows), then backs off to ``idle_poll_interval_s`` while a request waits on a peer, and further
(doubling up to ``DEEP_IDLE_S``) once nothing is live at all; engine calls and posts wake it at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, assert_never

from kvwire.connector.cadence import Cadence
from kvwire.connector.lag import LoopLag
from kvwire.connector.reports import Reporter, as_notification
from kvwire.connector.setup import checked_setup
from kvwire.connector.sidecalls import answer_claim, start_claim, start_handshake
from kvwire.connector.timeline import Stage, Timeline
from kvwire.core.base import CoreBase, DropReason, Feeder, Refused
from kvwire.core.config import ConnectorConfig
from kvwire.core.events import ConnectorStats
from kvwire.core.io import (
    Action,
    Allocated,
    AnswerClaim,
    Digest,
    Digested,
    Emit,
    Finished,
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
from kvwire.errors import (
    AuthError,
    ConfigError,
    KvwireError,
    PeerDisconnected,
    ProtocolError,
    TransportError,
)
from kvwire.handshake.lines import ClaimLines
from kvwire.handshake.loop import BackgroundLoop
from kvwire.handshake.manager import HandshakeManager, warm_up
from kvwire.handshake.server import ClaimVerdict, ServerStats, SideChannelServer
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.digest import kv_digest
from kvwire.kv.mapping import RankLayout
from kvwire.logsetup import Throttle
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import Claim, Done, PushReg, ReportFailed
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.seal import NotifGate
from kvwire.transport.base import Registration, XferHandle, XferOp, XferStatus

log = logging.getLogger("kvwire.connector")

E = TypeVar("E")

_TIMER_RESOLUTION_S = 0.001  # asyncio's call_later cannot wait less (see _on_tick)
_START_TIMEOUT_S = 10.0


class ConnectorBase(Generic[E]):
    """Owns the loop thread, the side-channel server, one handshake manager per local rank."""

    role = "connector"
    takes_reports = False  # D: its side channel takes P's report_failed (connector/reports.py)
    takes_claims = False  # a pull-mode P: its side channel takes D's claims (connector/sidecalls.py)

    def __init__(
        self,
        engine: EngineInfo,
        ranks: Sequence[LocalRank],
        config: ConnectorConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        loop: BackgroundLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
        warm_up: bool = True,
        advertise_host: str | None = None,
        accept_secret: bytes | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or ConnectorConfig()
        self.ranks, self.host = checked_setup(engine, self.config, ranks, host, advertise_host)
        # Where the side channel binds, and the address peers are told to dial (a push_reg's host): they
        # differ when binding every interface (0.0.0.0), which no peer can dial.
        self._bind_host = host
        self._port = port
        self._secret = secret
        self._accept_secret = accept_secret  # taken, never used to sign (KVWIRE_SECRET_ACCEPT)
        # With a secret every notification is sealed to its receiver, and only sealed ones are taken.
        self._gate = NotifGate(secret, accept_secret)
        self._clock = clock
        layouts = {
            key: RankLayout.from_cache(r.cache, pp_size=engine.pp_size, pp_rank=key[0])
            for key, r in self.ranks.items()
        }
        self.core = self._make_core(layouts, min(r.cache.num_blocks for r in ranks))
        self._allowed = PeerAllowList.parse(self.config.allowed_peers)  # who may be dialled at all
        self.reporter = self._make_reporter()
        self._warm_up = warm_up
        self._drop_log = Throttle()  # a peer may send a bad message at any rate: one line per 10 s
        self._own_loop = loop is None
        self._bg = loop
        self._server: SideChannelServer | None = None
        self.managers: dict[RankKey, HandshakeManager] = {}
        self._regs: list[tuple[LocalRank, Registration]] = []
        self._events: collections.deque[E] = collections.deque()
        self._on_event: Callable[[], None] | None = None
        self._started = False
        self._closed = False
        self._handles: dict[int, tuple[RankKey, XferHandle, str]] = {}  # token -> (rank, handle, tid)
        self.timeline = Timeline()  # when each step of a request happened here (``/v1/kv_stats``)
        self._feeder = Feeder(self.core, self._execute, self._failed)
        self._claim_verdicts: dict[int, AnswerClaim] = {}  # P: the core's answer to the claim being judged
        self._claim_token = 0
        self._init_ticker()

    def _init_ticker(self) -> None:
        self._ticker: concurrent.futures.Future[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._claim_lines: ClaimLines | None = None  # D, pull: kept connections for claims (sidecalls)
        # The next tick: a TimerHandle (waiting out an interval), a Handle (woken), None (ticking, stopped).
        self._next: asyncio.Handle | None = None
        self._woken = False
        self._ticking = False
        self._cadence = Cadence(self.config)  # when the next tick runs (adaptive polling)
        self.lag = LoopLag(self.role, self._clock)  # ticks that ran late, and why (logged)
        self._broken: set[RankKey] = set()

    def _make_reporter(self) -> Reporter:
        """P's ``report_failed`` driver: its core drops what it must, counted with the notifications."""
        return Reporter(
            timeout_s=self.config.handshake_timeout_s,
            secret=self._secret,
            clock=self._clock,
            drops=self.core.stats.dropped_notifs,
            allowed=self._allowed,
        )

    def _make_core(self, layouts: dict[RankKey, RankLayout], num_blocks: int) -> CoreBase:
        raise NotImplementedError

    @property
    def stats(self) -> ConnectorStats:
        return self.core.stats

    # -- lifecycle (engine thread) ---------------------------------------------------------------------
    def start(self) -> int:
        """Register every local cache, start the side channel and the ticker; returns the bound port. A
        start that fails (the port taken, say) undoes what it did, so that it can be called again."""
        if self._closed:
            raise ConfigError(f"the {self.role} is closed and cannot start again: make a new one")
        if self._started:
            return self._port
        try:
            return self._start()
        except BaseException:
            self._undo_start()  # the caller names the cause (``kvwire serve``: a port in use, and the fix)
            raise

    def _undo_start(self) -> None:
        """What a failed ``_start`` left: the side channel, an own loop thread, the registrations."""
        bg, server = self._bg, self._server
        if bg is not None and server is not None:
            with contextlib.suppress(Exception):
                bg.run(server.close(), _START_TIMEOUT_S)
        self._server = None
        if self._own_loop and bg is not None:
            bg.close()
            self._bg = None
        self._deregister()

    def _deregister(self) -> None:
        for rank, reg in self._regs:
            with contextlib.suppress(TransportError):
                rank.agent.deregister(reg)
        self._regs.clear()

    def _start(self) -> int:
        for rank in self.ranks.values():
            for buf in rank.cache.buffers():
                reg = rank.agent.register_range(
                    buf.addr, buf.length, buf.kind, buf.device_id, owner=buf.owner
                )
                self._regs.append((rank, reg))
        if self._warm_up:
            # NIXL's first agent load costs 10-30 ms: pay it here, not in the first request's handshake.
            warmed_s = warm_up([r.agent for r in self.ranks.values()], self._clock)
            if warmed_s:
                log.debug("%s: agents warmed up in %.1f ms", self.role, warmed_s * 1e3)
        if self._bg is None:
            self._bg = BackgroundLoop(name=f"kvwire-{self.role}")
        self._server = SideChannelServer(
            self.engine,
            list(self.ranks.values()),
            self._bind_host,
            self._port,
            self._secret,
            on_report=self._on_report if self.takes_reports else None,
            on_claim=self._on_claim if self.takes_claims else None,
            clock=self._clock,
            accept_secret=self._accept_secret,
        )
        self._port = self._bg.run(self._server.start(), _START_TIMEOUT_S)
        self.core.port = self._port
        cfg = self.config
        self.managers = {
            key: HandshakeManager(
                self.engine,
                rank,
                timeout_s=cfg.handshake_timeout_s,
                retries=cfg.handshake_retries,
                secret=self._secret,
                allowed=self._allowed,
                clock=self._clock,  # one clock: the core's now, the managers' and the breakers'
            )
            for key, rank in self.ranks.items()
        }
        self._ticker = self._bg.submit(self._run())
        self._started = True
        return self._port

    @property
    def port(self) -> int:
        return self._port

    @property
    def background_loop(self) -> BackgroundLoop | None:
        """The loop thread the connector runs on: the one passed in, or its own from ``start`` on (None
        before); after ``close`` an own loop is closed but still returned."""
        return self._bg

    def poll(self) -> list[E]:
        """Events since the last call (thread-safe, never blocks)."""
        out: list[E] = []
        pop = self._events.popleft
        while self._events:
            out.append(pop())
        return out

    def close(self) -> None:
        """Tell peers what ends here, stop the ticker and the side channel, unload peers; idempotent."""
        if self._closed or not self._started or self._bg is None:
            self._closed = True
            return
        self._closed = True
        bg = self._bg
        with contextlib.suppress(Exception):
            bg.run(self._shutdown(), _START_TIMEOUT_S)
        if self._own_loop:
            bg.close()
        self._deregister()

    async def _shutdown(self) -> None:
        # Before the engine is told its blocks may go (SHUTDOWN, below) no transfer may still read or write
        # them (close() deregisters the memory next): a release cancels one in flight (nixl-faults.md).
        for key, handle, _tid in self._handles.values():
            with contextlib.suppress(TransportError):
                self.ranks[key].agent.release(handle)
        self._handles.clear()
        for action in self.core.shutdown(self._clock()):
            self._execute(action)
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._tasks):
            task.cancel()
        for mgr in self.managers.values():
            with contextlib.suppress(Exception):
                await mgr.close()
        if self._claim_lines is not None:
            await self._claim_lines.close()
        if self._server is not None:
            await self._server.close()

    def __enter__(self) -> ConnectorBase[E]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hand-off from the engine thread ---------------------------------------------------------------
    def _check_running(self) -> None:
        """``ConfigError`` unless started and not closed: before an engine call records anything (a refused
        call left its transfer id marked used, and the same call after start() was refused as a reuse)."""
        if self._closed:
            raise ConfigError(f"the {self.role} is closed")
        if not self._started or self._bg is None:
            raise ConfigError(f"the {self.role} is not running (call start() first)")

    def _call(self, inp: Input) -> None:
        self._check_running()
        assert self._bg is not None  # _check_running
        self._bg.loop.call_soon_threadsafe(self._handoff, inp)

    def _handoff(self, inp: Input) -> None:
        now = self._clock()
        if isinstance(inp, Allocated | Finished):
            self.timeline.mark(inp.transfer_id, Stage.LOOP_RECEIVED, now)
        self._guarded(self._apply, (now, inp))
        self._wake()

    def _guarded(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        """The one way work enters the loop thread (engine calls, ticks, handshake answers): a bug in one
        handler must not stop the loop that every other request depends on."""
        try:
            fn(*args)
        except Exception:
            log.exception("%s: %s failed", self.role, getattr(fn, "__name__", fn))

    def on_event(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (from the loop thread; it must be thread-safe and quick) whenever ``poll``
        has something new, so the engine can sleep instead of polling while it waits for KV."""
        self._on_event = callback

    # -- core <-> I/O (loop thread) --------------------------------------------------------------------
    def _apply(self, now: float, inp: Input) -> None:
        """Feed ``inp``, then every ``Outcome`` its actions produce (``Feeder``: the cores' contract)."""
        self._feeder.feed(now, inp)

    def _failed(self, item: Input, exc: Exception) -> None:
        if isinstance(exc, Refused):
            self.stats.dropped_notifs[exc.reason.value] += 1
            self._drop_log.log(log, logging.WARNING, "%s: dropped %s", self.role, exc)
        elif isinstance(exc, KvwireError):
            log.warning("%s: %s refused: %s", self.role, type(item).__name__, exc)
        else:
            # A bug in one handler must not stop the loop that every other request depends on.
            log.error("%s: %s failed", self.role, type(item).__name__, exc_info=exc)

    def _execute(self, action: Action) -> None:
        match action:
            case Send():
                ok = self._send(action)
                if ok and isinstance(action.msg, PushReg):
                    self.timeline.mark(action.msg.transfer_id, Stage.PUSH_REG_SENT, self._clock())
                if action.token:
                    self._feeder.follow(Outcome(action.token, ok))
            case PostWrite() | PostRead():
                self._post(action)
            case Digest(token, key, scope):
                self._feeder.follow(Digested(token, kv_digest(self.ranks[key].cache, scope)))
            case Release(token):
                entry = self._handles.pop(token, None)
                if entry is not None:
                    with contextlib.suppress(TransportError):
                        self.ranks[entry[0]].agent.release(entry[1])
            case Emit(event):
                self._events.append(event)  # type: ignore[arg-type]
                if self._on_event is not None:
                    self._on_event()
            case StartHandshake():
                start_handshake(self, action)
            case SendClaim():
                start_claim(self, action)
            case AnswerClaim():
                self._claim_verdicts[action.token] = action
            case ReportFailure():
                task = self.reporter.submit(action)  # the report core drops what it must
                if task is not None:
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            case ForgetPeer(engine_id, incarnation):
                for mgr in self.managers.values():
                    mgr.forget(engine_id, incarnation)
            case TouchPeer(engine_id):
                for mgr in self.managers.values():
                    mgr.touch(engine_id)
            case Reap(in_use):
                self._reap(in_use)
            case _:
                assert_never(action)

    def _send(self, action: Send) -> bool:
        """Send one notification; False (logged) when the transport refuses."""
        self._cadence.activity(flush=True)  # an answer may follow; UCX may hold it until a progress call
        try:
            agent, peer = self.ranks[action.key].agent, action.peer
            agent.send_notif(peer, self._gate.outgoing(agent.name, peer, encode_notif(action.msg)))
        except PeerDisconnected as exc:
            log.debug("%s: %s to %s not sent: %s", self.role, type(action.msg).__name__, action.peer, exc)
            self._forget_agent(action.peer)  # its process is gone: nothing of it stays loaded
            return False
        except TransportError as exc:
            log.debug("%s: %s to %s not sent: %s", self.role, type(action.msg).__name__, action.peer, exc)
            return False
        return True

    def _post(self, action: PostWrite | PostRead) -> None:
        rank = self.ranks[action.key]
        write = isinstance(action, PostWrite)
        notif = None
        if isinstance(action, PostWrite) and action.notif is not None:
            notif = self._gate.outgoing(rank.agent.name, action.peer, action.notif)
        try:
            # The plan's [n, 3] arrays go to the transport as they are: no Desc object per descriptor.
            handle = rank.agent.post_array(
                XferOp.WRITE if write else XferOp.READ,
                action.src if write else action.dst,
                action.dst if write else action.src,
                action.peer,
                notif=notif,
                kind=rank.cache.mem_kind,
            )
        except TransportError as exc:
            self._feeder.follow(Outcome(action.token, False, str(exc)))
            return
        self._handles[action.token] = (action.key, handle, action.transfer_id)
        if write:
            self.timeline.mark(action.transfer_id, Stage.WRITE_POSTED, self._clock())
        self._feeder.follow(Outcome(action.token, True))
        self._wake()  # poll it at the busy rate from now on

    def _on_claim(self, claim: Claim) -> ClaimVerdict:
        """A D's authenticated ``claim`` (side channel, same loop), judged by the core at once."""
        return answer_claim(self, claim)

    def _new_claim_token(self) -> int:
        self._claim_token += 1
        return self._claim_token

    def _on_report(self, report: ReportFailed) -> None:
        """A peer's authenticated ``report_failed`` (side channel, same loop): the ``failed`` it means."""
        self._guarded(self._apply, (self._clock(), as_notification(report)))
        self._wake()

    def _forget_agent(self, agent_name: str) -> None:
        """The agent's process is gone: the handshake core that loaded it forgets that engine life, and
        so does every other rank's."""
        for mgr in self.managers.values():
            life = mgr.forget_agent(agent_name)
            if life is not None:
                for m in self.managers.values():
                    m.forget(*life)
                return

    def _reap(self, in_use: frozenset[str]) -> None:
        """Refresh the peers live requests use, then unload those idle past ``engine_ttl_s`` (S1)."""
        for mgr in self.managers.values():
            for engine_id in mgr.reap_idle(ttl_s=self.config.engine_ttl_s, in_use=in_use):
                self.stats.peers_reaped += 1
                log.info(
                    "%s: peer %s idle past %.0f s: unloaded", self.role, engine_id, self.config.engine_ttl_s
                )

    # -- the ticker (loop thread) ----------------------------------------------------------------------
    async def _run(self) -> None:
        """Ticks until cancelled. Each tick is a plain loop callback (no future, no task step per pass);
        this coroutine only holds the ticker's life, so cancelling ``_ticker`` stops the ticks."""
        loop = asyncio.get_running_loop()
        self._ticking = True
        self.lag.due(self._clock())
        self._next = loop.call_soon(self._on_tick, loop)
        try:
            await loop.create_future()  # never resolved: runs until cancelled
        finally:
            self._ticking = False
            if self._next is not None:
                self._next.cancel()
                self._next = None

    @property
    def side_channel_stats(self) -> ServerStats | None:
        return self._server.stats if self._server is not None else None

    def _on_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._next, self._woken = None, False
        now = self._clock()
        self.lag.ran(now, log)
        self._guarded(self._tick, (now,))
        if self._ticking and self._next is None:
            interval = self._interval(now)
            self.lag.due(now + interval)  # from the tick's start: a tick that blocked the loop shows too
            if interval < _TIMER_RESOLUTION_S and self._own_loop:
                # asyncio waits in epoll, which rounds every timeout up to a whole millisecond (1.1 ms
                # measured for 50 us or 0.5 ms): a shorter wait is slept here (the GIL is released), and
                # the loop's other callbacks run between this tick and the next. Only on a loop of our
                # own: a shared one (tests, benchmarks) would stall its other connectors meanwhile.
                time.sleep(interval)
                self._next = loop.call_soon(self._on_tick, loop)
            else:
                self._next = loop.call_later(interval, self._on_tick, loop)

    def awaiting(self) -> bool:
        """Something a fast poll may hurry: a transfer posted, a handshake or report running, or a live
        request (one whose timers may act soon, not only tombstones)."""
        return bool(self._handles or self._tasks or self.core.live)

    def _interval(self, now: float) -> float:
        """How long until the next tick (``Cadence.interval``)."""
        core = self.core
        return self._cadence.interval(now, core.busy, self.awaiting(), core.wake_at)

    def _wake(self) -> None:
        """Run the next tick as soon as the loop is free (loop thread only): work that just started (an
        engine call, a posted transfer) is polled at once instead of after an idle interval."""
        self._cadence.activity()
        nxt = self._next
        if nxt is None or self._woken:
            return  # ticking now (the next interval is short after activity) or already woken
        nxt.cancel()
        self._woken = True
        loop = asyncio.get_running_loop()
        self._next = loop.call_soon(self._on_tick, loop)

    def _tick(self, now: float) -> None:
        # Time first: a P that was frozen recalls its writes before anything progresses them.
        self._apply(now, Tick())
        for key, rank in self.ranks.items():
            try:
                inbox = rank.agent.drain_notifs()
            except TransportError as exc:
                # Once per rank: a closed or dead agent would otherwise log at every tick.
                if key not in self._broken:
                    self._broken.add(key)
                    log.warning("%s: draining notifs of %s failed: %s", self.role, rank.agent.name, exc)
                continue
            for sender, msgs in inbox.items():
                for sealed in msgs:
                    # Not activity: what it calls for (a send, a post) starts the fast polls. A ramp per
                    # arrival took the GIL from the prefill of the request D had just registered.
                    self._cadence.heard(now)
                    try:  # one message, whatever it holds, never costs the rest of the batch
                        self._take_notif(now, key, sender, sealed)
                    except Exception as exc:
                        self._failed(NotifIn(key, sender, sealed), exc)
        self._poll_transfers(now)

    def _take_notif(self, now: float, key: RankKey, sender: str, sealed: bytes) -> None:
        try:  # NIXL lets a sender pick any name: only the seal says who sent it
            raw = self._gate.incoming(sender, self.ranks[key].agent.name, sealed)
        except AuthError as exc:
            raise Refused(self.role, DropReason.UNAUTHENTICATED, str(exc)) from None
        with contextlib.suppress(ProtocolError):  # timeline marks; the core's own decode judges and counts
            msg = decode_notif(raw)
            if isinstance(msg, PushReg | Done):
                stage = Stage.PUSH_REG_RECEIVED if isinstance(msg, PushReg) else Stage.DONE_RECEIVED
                self.timeline.mark(msg.transfer_id, stage, now)
        self._apply(now, NotifIn(key, sender, raw))

    def _poll_transfers(self, now: float) -> None:
        for token, (key, handle, transfer_id) in list(self._handles.items()):
            if token not in self._handles:
                continue  # released by an earlier end in this pass (a layer-wise registration's other writes)
            try:
                state = self.ranks[key].agent.status(handle)
            except TransportError:
                state = XferStatus.FAILED
            if state is XferStatus.IN_PROGRESS:
                continue
            # The peer's answer (or the next write) usually follows; a WRITE's attached notification was
            # just handed to UCX by this status check, and may wait there for a progress call.
            self._cadence.activity(flush=True)
            # The clock now, not the tick's ``now``: this tick may have posted the write after it began.
            self.timeline.mark(transfer_id, Stage.WRITE_DONE, self._clock())
            reason = handle.failed_reason if isinstance(handle.failed_reason, str) else ""
            self._apply(now, XferEnded(token, state is XferStatus.DONE, reason))
