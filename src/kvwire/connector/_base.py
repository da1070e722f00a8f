"""What the producer and the consumer share: the background loop, the notification pump, handshakes.

Threading. Every call on an agent, on a handshake manager and on the connector's request state happens
on ONE thread: the background asyncio loop's. The engine's call sites (``request_finished``,
``request_allocated``, ``abort``) only schedule work there (``call_soon_threadsafe``) and return at once;
``poll`` only pops events from a queue. So the engine thread never waits on the network, and neither the
agents (NIXL's Python layer is not thread-safe) nor the state need locks.

The loop runs a ticker: progress every agent, drain and dispatch its notifications, poll posted transfers,
and every few milliseconds check the timers (fences, leases, liveness, heartbeats, idle peers). It ticks
every ``poll_interval_s`` while transfers are live and for a few ticks after any activity (a peer's answer
usually follows), then backs off to ``idle_poll_interval_s``; engine calls and posts wake it at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvwire.connector.config import ConnectorConfig
from kvwire.connector.events import ConnectorStats
from kvwire.errors import ConfigError, KvwireError, PeerDisconnected, ProtocolError, TransportError
from kvwire.handshake.loop import BackgroundLoop
from kvwire.handshake.manager import HandshakeManager, warm_up
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import EngineInfo, LocalRank, PeerRank
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import Notification
from kvwire.transport.base import PeerMode, Registration, XferHandle, XferStatus

log = logging.getLogger("kvwire.connector")

RankKey = tuple[int, int]  # (pp_rank, tp_rank) of a local rank
E = TypeVar("E")

_TIMER_PERIOD_S = 0.005
_HOT_TICKS = 4  # ticks at the busy rate after any activity (see ConnectorBase._interval)
_START_TIMEOUT_S = 10.0
_WILDCARDS = ("0.0.0.0", "::", "")


def sender_matches(sender: str, engine_id: str, incarnation: str) -> bool:
    """Whether a NIXL sender name belongs to the engine life a message claims (``make_agent_name``)."""
    return sender.startswith(f"{engine_id}/{incarnation}/")


class ConnectorBase(Generic[E]):
    """Owns the loop thread, the side-channel server, one handshake manager per local rank."""

    role = "connector"

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
    ) -> None:
        self.engine = engine
        self.config = config or ConnectorConfig()
        if self.config.mode is not engine.transfer_mode:
            raise ConfigError(
                f"config mode {self.config.mode.value} != engine's {engine.transfer_mode.value}"
            )
        self.ranks: dict[RankKey, LocalRank] = {(r.pp_rank, r.tp_rank): r for r in ranks}
        if not ranks or len(self.ranks) != len(ranks):
            raise ConfigError("a connector needs at least one local rank, each (pp, tp) once")
        # Where the side channel binds, and the address peers are told to dial (a push_reg's host): they
        # differ when binding every interface (0.0.0.0), which no peer can dial.
        self._bind_host = host
        self.host = advertise_host or host
        if self.host in _WILDCARDS:
            raise ConfigError(
                f"side channel bound to {host!r} (every interface) but no address to advertise: set "
                "KVWIRE_SIDE_CHANNEL_HOST (or advertise_host) to the address peers should dial"
            )
        self._port = port
        self._secret = secret
        self._clock = clock
        self._warm_up = warm_up
        self._own_loop = loop is None
        self._bg = loop
        self._server: SideChannelServer | None = None
        self.managers: dict[RankKey, HandshakeManager] = {}
        self._regs: list[tuple[LocalRank, Registration]] = []
        self._events: collections.deque[E] = collections.deque()
        self._on_event: Callable[[], None] | None = None
        self._ticker: concurrent.futures.Future[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._next_timers = 0.0
        # The next tick: a TimerHandle while waiting out an interval, a Handle once woken, None while
        # ticking or stopped.
        self._next: asyncio.Handle | None = None
        self._woken = False
        self._ticking = False
        self._quiet = 0  # ticks since the last activity (adaptive polling, see _interval)
        self._broken: set[RankKey] = set()
        self._started = False
        self._closed = False
        self.stats = ConnectorStats()
        self._setup()

    def _setup(self) -> None:
        """Subclasses create their request table here."""

    # -- lifecycle (engine thread) ---------------------------------------------------------------------
    def start(self) -> int:
        """Register every local cache, start the side channel and the ticker; returns the bound port."""
        if self._started:
            return self._port
        for rank in self.ranks.values():
            for buf in rank.cache.buffers():
                reg = rank.agent.register_range(
                    buf.addr, buf.length, buf.kind, buf.device_id, owner=buf.owner
                )
                self._regs.append((rank, reg))
        if self._warm_up:
            # NIXL's first agent load costs 10-30 ms: pay it here, not in the first request's handshake.
            warmed_s = warm_up([r.agent for r in self.ranks.values()])
            if warmed_s:
                log.debug("%s: agents warmed up in %.1f ms", self.role, warmed_s * 1e3)
        if self._bg is None:
            self._bg = BackgroundLoop(name=f"kvwire-{self.role}")
        self._server = SideChannelServer(
            self.engine, list(self.ranks.values()), self._bind_host, self._port, self._secret
        )
        self._port = self._bg.run(self._server.start(), _START_TIMEOUT_S)
        cfg = self.config
        self.managers = {
            key: HandshakeManager(
                self.engine,
                rank,
                timeout_s=cfg.handshake_timeout_s,
                retries=cfg.handshake_retries,
                secret=self._secret,
            )
            for key, rank in self.ranks.items()
        }
        self._ticker = self._bg.submit(self._run())
        self._started = True
        return self._port

    @property
    def port(self) -> int:
        return self._port

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
        for rank, reg in self._regs:
            with contextlib.suppress(TransportError):
                rank.agent.deregister(reg)
        self._regs.clear()

    async def _shutdown(self) -> None:
        self._on_shutdown()
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._tasks):
            task.cancel()
        for mgr in self.managers.values():
            with contextlib.suppress(Exception):
                await mgr.close()
        if self._server is not None:
            await self._server.close()

    def __enter__(self) -> ConnectorBase[E]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hand-off from the engine thread ---------------------------------------------------------------
    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        if not self._started or self._closed or self._bg is None:
            raise ConfigError(f"the {self.role} is not running (call start() first)")
        self._bg.loop.call_soon_threadsafe(self._handoff, fn, args)

    def _handoff(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._guarded(fn, args)
        self._wake()

    def _guarded(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        # A bug in one handler must not stop the loop that every other request depends on.
        try:
            fn(*args)
        except Exception:
            log.exception("%s: %s failed", self.role, getattr(fn, "__name__", fn))

    def on_event(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (from the loop thread; it must be thread-safe and quick) whenever ``poll``
        has something new, so the engine can sleep instead of polling while it waits for KV."""
        self._on_event = callback

    def _emit(self, event: E) -> None:
        self._events.append(event)
        if self._on_event is not None:
            self._on_event()

    # -- the ticker (loop thread) ----------------------------------------------------------------------
    async def _run(self) -> None:
        """Ticks until cancelled. Each tick is a plain loop callback (no future, no task step per pass);
        this coroutine only holds the ticker's life, so cancelling ``_ticker`` stops the ticks."""
        loop = asyncio.get_running_loop()
        self._ticking = True
        self._next = loop.call_soon(self._on_tick, loop)
        try:
            await loop.create_future()  # never resolved: runs until cancelled
        finally:
            self._ticking = False
            if self._next is not None:
                self._next.cancel()
                self._next = None

    def _on_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._next, self._woken = None, False
        self._guarded(self._tick, (self._clock(),))
        if self._ticking and self._next is None:
            self._next = loop.call_later(self._interval(), self._on_tick, loop)

    def _interval(self) -> float:
        """Fast while transfers are live; after any activity (an engine call, a notification in or out, a
        post) fast for ``_HOT_TICKS`` more ticks, then doubling back to the idle interval. A peer's answer
        usually follows soon after activity, and NIXL has no descriptor to wait on: this catches it
        without polling fast all the time."""
        cfg = self.config
        if self._busy():
            self._quiet = 0
            return cfg.poll_interval_s
        self._quiet += 1
        if self._quiet <= _HOT_TICKS:
            return cfg.poll_interval_s
        return min(cfg.idle_poll_interval_s, cfg.poll_interval_s * (1 << min(self._quiet - _HOT_TICKS, 16)))

    def _wake(self) -> None:
        """Run the next tick as soon as the loop is free (loop thread only): work that just started (an
        engine call, a posted transfer) is polled at once instead of after an idle interval."""
        self._quiet = 0
        nxt = self._next
        if nxt is None or self._woken:
            return  # ticking now (the next interval is short after activity) or already woken
        nxt.cancel()
        self._woken = True
        loop = asyncio.get_running_loop()
        self._next = loop.call_soon(self._on_tick, loop)

    def _tick(self, now: float) -> None:
        for key, rank in self.ranks.items():
            try:
                inbox = rank.agent.drain_notifs()
            except TransportError as exc:
                # Once per rank: a closed or dead agent would otherwise log at every tick.
                if key not in self._broken:
                    self._broken.add(key)
                    log.warning(
                        "%s: draining notifications of %s failed: %s", self.role, rank.agent.name, exc
                    )
                continue
            for sender, msgs in inbox.items():
                for raw in msgs:
                    self._receive(key, sender, raw, now)
        self._poll_transfers(now)
        if now >= self._next_timers:
            self._next_timers = now + _TIMER_PERIOD_S
            self._timers(now)

    def _receive(self, key: RankKey, sender: str, raw: bytes, now: float) -> None:
        try:
            msg = decode_notif(raw)
        except ProtocolError as exc:
            self._drop("malformed", f"from {sender}: {exc}")
            return
        self._quiet = 0
        if not sender_matches(sender, msg.engine_id, msg.incarnation):
            self._drop(
                "wrong_sender",
                f"{type(msg).__name__} claims {msg.engine_id}/{msg.incarnation}, sent by {sender}",
            )
            return
        self._on_notif(key, sender, msg, now)

    def _drop(self, why: str, detail: str) -> None:
        self.stats.dropped_notifs[why] += 1
        log.debug("%s: dropped notification (%s): %s", self.role, why, detail)

    def _poll_xfer(
        self, key: RankKey, handle: XferHandle, posted_at: float, now: float
    ) -> tuple[XferStatus, bool] | None:
        """Poll one transfer of local rank ``key``: None while it runs within ``transfer_timeout_s``;
        otherwise (DONE or not, whether it timed out), its handle already released and a DONE one counted."""
        agent = self.ranks[key].agent
        try:
            state = agent.status(handle)
        except TransportError:
            state = XferStatus.FAILED
        timed_out = state is XferStatus.IN_PROGRESS and now - posted_at > self.config.transfer_timeout_s
        if state is XferStatus.IN_PROGRESS and not timed_out:
            return None
        agent.release(handle)  # first: a timed-out transfer is cancelled before it is reported
        if state is XferStatus.DONE:
            self.stats.bytes_moved += handle.nbytes
            self.stats.record_duration(now - posted_at)
        return state, timed_out

    def _send(self, key: RankKey, peer: str, msg: Notification) -> bool:
        """Send one notification; False (logged) when the transport refuses."""
        self._quiet = 0  # an answer may follow
        try:
            self.ranks[key].agent.send_notif(peer, encode_notif(msg))
        except PeerDisconnected as exc:
            log.debug("%s: %s to %s not sent: %s", self.role, type(msg).__name__, peer, exc)
            self._forget_agent(peer)  # its process is gone: nothing of it stays loaded
            return False
        except TransportError as exc:
            log.debug("%s: %s to %s not sent: %s", self.role, type(msg).__name__, peer, exc)
            return False
        return True

    def _handshake(
        self,
        key: RankKey,
        host: str,
        port: int,
        remote: RankKey,
        mode: PeerMode,
        done: Callable[[PeerRank | None, BaseException | None], None],
        engine_id: str | None = None,
        incarnation: str | None = None,
    ) -> None:
        """Start ``ensure`` on the loop; ``done(peer, error)`` runs on the loop when it ends."""
        self.stats.handshakes_started += 1
        mgr = self.managers[key]
        try:
            hit = mgr.cached(
                host, port, remote[0], remote[1], mode, engine_id=engine_id, incarnation=incarnation
            )
        except KvwireError as exc:
            self.stats.handshakes_failed += 1
            asyncio.get_running_loop().call_soon(self._guarded, done, (None, exc))
            return
        if hit is not None:
            # Cached (the usual case): no task; ``done`` still runs later, as after a handshake, so callers
            # never see it re-entrantly.
            asyncio.get_running_loop().call_soon(self._guarded, done, (hit, None))
            return
        coro = mgr.ensure(
            host, port, remote[0], remote[1], mode, engine_id=engine_id, incarnation=incarnation
        )
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def finished(t: asyncio.Future[PeerRank]) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None and not isinstance(exc, KvwireError):
                log.error("%s: handshake with %s:%d raised %r", self.role, host, port, exc)
            if exc is not None:
                self.stats.handshakes_failed += 1
            self._guarded(done, (None if exc is not None else t.result(), exc))

        task.add_done_callback(finished)

    def _forget_peer(self, engine_id: str, incarnation: str | None = None) -> None:
        """Unload a peer's agents from every local rank (only that life of it, when ``incarnation``)."""
        for mgr in self.managers.values():
            mgr.forget(engine_id, incarnation)

    def _forget_agent(self, agent_name: str) -> None:
        for mgr in self.managers.values():
            for peer in mgr.peers():
                if peer.agent_name == agent_name:
                    self._forget_peer(peer.engine_id, peer.incarnation)
                    return

    def _touch_peer(self, engine_id: str) -> None:
        now = time.monotonic()  # the managers' scale, whatever clock the connector's timers use
        for mgr in self.managers.values():
            mgr.touch(engine_id, now)

    def _reap(self, in_use: set[str]) -> None:
        """Refresh the peers live requests use, then unload those idle past ``engine_ttl_s`` (S1)."""
        # The managers keep time.monotonic(), whatever clock the connector's timers use.
        now = time.monotonic()
        for mgr in self.managers.values():
            for engine_id in in_use:
                mgr.touch(engine_id, now)
            for engine_id in mgr.reap_idle(now, self.config.engine_ttl_s):
                self.stats.peers_reaped += 1
                log.info(
                    "%s: peer %s idle past %.0f s: unloaded", self.role, engine_id, self.config.engine_ttl_s
                )

    # -- hooks -----------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return False

    def _on_notif(self, key: RankKey, sender: str, msg: Notification, now: float) -> None:
        raise NotImplementedError

    def _poll_transfers(self, now: float) -> None:
        pass

    def _timers(self, now: float) -> None:
        pass

    def _on_shutdown(self) -> None:
        pass
