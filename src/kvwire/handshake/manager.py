"""HandshakeManager: cached, deduplicated, concurrent handshakes of one local agent with remote ranks.

Theory of operation. ``ensure(host, port, pp, tp, mode)`` returns a ``PeerRank`` loaded into the local
agent at least in ``mode``. Entries are cached per peer address and rank, and carry the peer's
(engine_id, incarnation): a reply with another incarnation means the peer restarted, so the old remote
agent is removed before the new one is added (NIXL breaks an entry re-added under a live name).

* Concurrent callers for one address share the one handshake in flight (``asyncio.shield``: a caller
  that is cancelled does not cancel it for the others).
* NOTIF_ONLY -> FULL is an upgrade: one request for the full metadata, loaded over the notif-only entry;
  the clock offset already measured is kept. A FULL entry serves NOTIF_ONLY callers as is.
* A FULL handshake prepares no descriptor list: the producer posts explicit coalesced descriptors built
  per request from the regions' base addresses, so the cost is O(regions), not O(regions x blocks);
  it validates the geometry (region count, block length, block count, TP and PP) and builds a RankLayout.
* Each handshake has a deadline (``timeout_s``, default 5 s) covering all its attempts and the load of
  the peer's agent; connection failures are retried (``retries``, exponential backoff) while time is left.
  Handshakes to different peers are independent tasks, so a dead peer delays no other.
* Loading the peer's agent can wait on the network (UCX connects while NIXL loads): ``Agent.load_peer``
  runs it off the loop within what is left of the deadline. A load past it fails the handshake with
  ``HandshakeTimeout`` and stays stuck in the agent's worker (undone if it ever succeeds); while it is
  stuck, further loads on that agent are refused at once, and ``stalled_s`` says for how long, for
  ``/health``.
* One INFO line per completed handshake, one WARNING line per failed one (logger ``kvwire.handshake``).

Each address's entry lives through ``PeerHandshake`` (``kvwire.protocol.states``, table ``HANDSHAKE_TABLE``):
a first fetch is FETCH then LOADED_NOTIF_ONLY / LOADED_FULL or FETCH_FAILED (a later ``ensure`` fetches
again from FAILED); NOTIF_ONLY -> FULL is UPGRADE then LOADED_FULL, or UPGRADE_FAILED back to NOTIF_ONLY;
``forget``, reaping, ``close`` and a reply from another incarnation are REMOVE, and the new life at that
address gets a new machine (FETCH at the reply that found it). A refresh (the caller knows another life than
the entry's) keeps the entry in service until the reply: of the same life it changes nothing (or upgrades
a notif-only entry it answered in full). A step the table refuses raises ``IllegalTransition``. ``state``
reads an address's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvwire.errors import (
    AgentBusy,
    AgentStalled,
    HandshakeError,
    HandshakeTimeout,
    IncompatiblePeer,
    KvwireError,
    LayoutError,
    NobodyListens,
    NoSuchRank,
    PeerNotAllowed,
    PeerUnreachable,
    TransportError,
    Unauthorized,
)
from kvwire.handshake.breaker import CircuitBreaker
from kvwire.handshake.client import Fetched, fetch_metadata
from kvwire.handshake.layout import validate_layout
from kvwire.handshake.server import engine_compat_hash
from kvwire.handshake.types import (
    EngineInfo,
    FailureReason,
    HandshakeManagerStats,
    LocalRank,
    PeerAddress,
    PeerRank,
)
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.states import HandshakeEvent, HandshakeState, PeerHandshake
from kvwire.transport.base import Agent, PeerMode

log = logging.getLogger("kvwire.handshake")

_MAX_BACKOFF_S = 2.0
_ENSURE_ROUNDS = 4  # a caller waits on at most: a notif-only in flight, an upgrade, a re-handshake


def _satisfies(have: PeerMode, want: PeerMode) -> bool:
    return have is PeerMode.FULL or want is PeerMode.NOTIF_ONLY


def _trips_breaker(exc: BaseException) -> bool:
    """A failure of the address on the network that cost time: not a refusal it answered, not a refused
    connection (fast, and what a restarting peer answers for a moment), not our own agent held."""
    if isinstance(exc, AgentBusy | NobodyListens) or isinstance(exc.__cause__, AgentBusy):
        return False
    if isinstance(exc.__cause__, TransportError):
        return True  # the load of the peer's agent failed in UCX (an endpoint it could not create)
    return _reason(exc) in (FailureReason.TIMEOUT, FailureReason.UNREACHABLE, FailureReason.TRANSPORT)


def _reason(exc: BaseException) -> FailureReason:
    for cls, reason in (
        (HandshakeTimeout, FailureReason.TIMEOUT),
        (PeerUnreachable, FailureReason.UNREACHABLE),
        (IncompatiblePeer, FailureReason.INCOMPATIBLE),
        (LayoutError, FailureReason.INCOMPATIBLE),
        (Unauthorized, FailureReason.UNAUTHORIZED),
        (NoSuchRank, FailureReason.NO_SUCH_RANK),
        (TransportError, FailureReason.TRANSPORT),
    ):
        if isinstance(exc, cls):
            return reason
    return FailureReason.BAD_REPLY


@dataclass
class _Steps:
    """Seconds spent in each step of one handshake (for the log lines and the stats)."""

    attempts: int = 0
    fetch: float = 0.0
    add_agent: float = 0.0
    prepare: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def ms(self) -> str:
        total = time.perf_counter() - self.started
        return (
            f"attempts={self.attempts} fetch={self.fetch * 1e3:.1f}ms load={self.add_agent * 1e3:.1f}ms "
            f"prepare={self.prepare * 1e3:.1f}ms total={total * 1e3:.1f}ms"
        )


class HandshakeManager:
    """Handshakes of one local rank (one local agent) with remote ranks."""

    def __init__(
        self,
        engine: EngineInfo,
        local: LocalRank,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        secret: bytes | None = None,
        clock_samples: int = 3,
        clock_rtt_target_s: float = 0.002,
        breaker: CircuitBreaker | None = None,
        allowed: PeerAllowList | None = None,
    ) -> None:
        self.engine = engine
        self.local = local
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.clock_samples = clock_samples
        # An offset is off by at most RTT/2: below this RTT one sample is enough (timers work in ms).
        self.clock_rtt_target_s = clock_rtt_target_s
        self._secret = secret or None
        self._compat = engine_compat_hash(engine)
        self._peers: dict[PeerAddress, PeerRank] = {}
        self._inflight: dict[PeerAddress, asyncio.Task[PeerRank]] = {}
        # The life of each address's entry (see the module's docstring); REMOVED ones are replaced on use.
        self._machines: dict[PeerAddress, PeerHandshake] = {}
        self._last_used: dict[str, float] = {}  # engine_id -> monotonic time
        self.stats = HandshakeManagerStats()
        # Addresses whose last handshakes failed on the network fail fast for a while (breaker.py).
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.allowed = allowed if allowed is not None else PeerAllowList()

    # -- public API ------------------------------------------------------------------------------------

    async def ensure(
        self,
        host: str,
        port: int,
        pp_rank: int,
        tp_rank: int,
        mode: PeerMode,
        *,
        engine_id: str | None = None,
        incarnation: str | None = None,
    ) -> PeerRank:
        """The remote rank loaded into the local agent at least in ``mode``.

        ``engine_id``, when given, must match the peer's (else ``IncompatiblePeer``). ``incarnation``, when
        given, is the one the caller knows of (e.g. from a message): a cached entry of another incarnation
        is refreshed first. The peer's answer wins; compare ``PeerRank.incarnation`` to detect stale
        messages.
        """
        if not self.allowed.allows(host):
            self.stats.not_allowed += 1
            raise PeerNotAllowed(f"{host}:{port} is not in allowed_peers: not dialled")
        addr = PeerAddress(host, port, pp_rank, tp_rank)
        hit = self._hit(addr, mode, engine_id, incarnation)
        if hit is not None:
            return hit
        peer: PeerRank | None = None
        for _ in range(_ENSURE_ROUNDS):
            cached = self._peers.get(addr)
            fresh = cached is not None and incarnation in (None, cached.incarnation)
            # Not on the first round (``_hit`` said no and nothing awaited since): another caller's
            # handshake may have loaded it meanwhile.
            if cached is not None and fresh and _satisfies(cached.mode, mode):
                return self._checked(cached, engine_id)
            task = self._inflight.get(addr)
            if task is None:
                # The life asked for, else the cached one: a trip by another life does not hold it.
                life = incarnation if incarnation is not None or cached is None else cached.incarnation
                self.breaker.check(host, port, life)  # CircuitOpen: counted by the breaker, not logged
                want = mode if cached is None or fresh else max_mode(mode, cached.mode)
                handshake = self._handshake(addr, want, cached if fresh else None, cached, life)
                task = asyncio.create_task(handshake)
                self._inflight[addr] = task
                task.add_done_callback(functools.partial(self._done, addr))
            elif peer is None:
                self.stats.deduped += 1
            peer = await asyncio.shield(task)
            # A handshake answered for us: the peer's incarnation wins over the caller's.
            if _satisfies(peer.mode, mode):
                return self._checked(peer, engine_id)
        raise HandshakeError(f"{addr}: not loaded in mode {mode.value} after {_ENSURE_ROUNDS} rounds")

    def cached(
        self,
        host: str,
        port: int,
        pp_rank: int,
        tp_rank: int,
        mode: PeerMode,
        *,
        engine_id: str | None = None,
        incarnation: str | None = None,
    ) -> PeerRank | None:
        """What ``ensure`` would return at once from the cache (counted as a hit), or None when it would
        have to handshake. Raises ``IncompatiblePeer`` as ``ensure`` does. No I/O, no await: callers on
        the loop skip a task per request."""
        return self._hit(PeerAddress(host, port, pp_rank, tp_rank), mode, engine_id, incarnation)

    def _hit(
        self, addr: PeerAddress, mode: PeerMode, engine_id: str | None, incarnation: str | None
    ) -> PeerRank | None:
        cached = self._peers.get(addr)
        if (
            cached is None
            or incarnation not in (None, cached.incarnation)
            or not _satisfies(cached.mode, mode)
        ):
            return None
        self.stats.cache_hits += 1
        return self._checked(cached, engine_id)

    def forget(self, engine_id: str, incarnation: str | None = None) -> None:
        """The peer is dead or gone: remove its remote agents and drop its entries. With ``incarnation``,
        only that life of it: a restarted peer already loaded under its new incarnation stays."""
        for addr, peer in list(self._peers.items()):
            if peer.engine_id == engine_id and incarnation in (None, peer.incarnation):
                self._drop(addr, peer)
        if any(p.engine_id == engine_id for p in self._peers.values()):
            return
        if self._last_used.pop(engine_id, None) is not None:
            self.stats.forgotten += 1

    def touch(self, engine_id: str, now: float) -> None:
        """Mark ``engine_id`` in use at ``now`` (``time.monotonic()`` scale)."""
        self._last_used[engine_id] = now

    def reap_idle(self, now: float, ttl_s: float) -> list[str]:
        """Forget peers not used for ``ttl_s`` (vLLM's engine_ttl); returns their engine ids."""
        idle = [eid for eid, used in self._last_used.items() if now - used > ttl_s]
        for eid in idle:
            self.forget(eid)
        return idle

    def peers(self) -> list[PeerRank]:
        return list(self._peers.values())

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds a peer load of this rank's agent has been stuck past its deadline (0.0 when none is).

        Non-zero means the agent is held inside NIXL (an unreachable UCX port): this rank moves no KV and
        refuses new handshakes until the call returns. Safe to read from any thread (``/health``)."""
        return self.local.agent.stalled_s(now)

    @property
    def stuck_loads(self) -> int:
        """Peer loads of this rank's agent that overran their handshake's deadline, since start."""
        return self.local.agent.stuck_calls

    def peer(self, host: str, port: int, pp_rank: int, tp_rank: int) -> PeerRank | None:
        """The cached entry of one remote rank, if any (no I/O)."""
        return self._peers.get(PeerAddress(host, port, pp_rank, tp_rank))

    def state(self, host: str, port: int, pp_rank: int, tp_rank: int) -> HandshakeState:
        """Where the entry of one remote rank stands in ``HANDSHAKE_TABLE`` (UNKNOWN if never fetched)."""
        machine = self._machines.get(PeerAddress(host, port, pp_rank, tp_rank))
        return HandshakeState.UNKNOWN if machine is None else machine.state

    async def close(self) -> None:
        """Cancel handshakes in flight and unload every remote agent; idempotent."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for addr, peer in list(self._peers.items()):
            self._drop(addr, peer)
        for machine in self._machines.values():
            if not machine.is_terminal:
                machine.handle(HandshakeEvent.REMOVE)
        self._machines.clear()
        self._last_used.clear()

    # -- one handshake ---------------------------------------------------------------------------------

    def _done(self, addr: PeerAddress, task: asyncio.Task[PeerRank]) -> None:
        if self._inflight.get(addr) is task:
            del self._inflight[addr]
        if not task.cancelled():
            task.exception()  # retrieved: callers re-raise it; unawaited failures must not warn

    def _checked(self, peer: PeerRank, engine_id: str | None) -> PeerRank:
        if engine_id is not None and peer.engine_id != engine_id:
            raise IncompatiblePeer(
                f"{peer.host}:{peer.port} is engine {peer.engine_id}, not the expected {engine_id}"
            )
        self._last_used[peer.engine_id] = time.monotonic()
        return peer

    async def _handshake(
        self,
        addr: PeerAddress,
        mode: PeerMode,
        base: PeerRank | None,
        stale: PeerRank | None,
        life: str | None = None,
    ) -> PeerRank:
        """Fetch, add the agent, prepare. ``base`` is a notif-only entry to upgrade; ``stale`` any entry
        the answer may replace; ``life`` the incarnation sought, if known (a network failure trips the
        breaker for it)."""
        steps = _Steps()
        upgrade = base is not None and base.mode is PeerMode.NOTIF_ONLY and mode is PeerMode.FULL
        machine = self._machine(addr)
        if stale is None:
            machine.handle(HandshakeEvent.FETCH)
        elif upgrade:
            machine.handle(HandshakeEvent.UPGRADE)
        # else a refresh: the entry stays in service (and in its state) until the reply says whose it is
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            samples = 1 if upgrade else self.clock_samples
            fetched = await self._fetch(addr, mode, steps, samples, deadline)
            md = fetched.metadata
            if stale is not None and (stale.engine_id, stale.incarnation) != (md.engine_id, md.incarnation):
                self._drop(addr, stale)  # REMOVE: that life is over
                self.stats.replaced += 1
                upgrade = False
                machine = self._machine(addr)
                machine.handle(HandshakeEvent.FETCH)  # the new life, found by this fetch
            t0 = time.perf_counter()
            try:
                name = await self._add_agent(addr, md.agent_name, md.agent_metadata, deadline)
            finally:
                steps.add_agent = time.perf_counter() - t0
            t1 = time.perf_counter()
            layout = None if mode is PeerMode.NOTIF_ONLY else validate_layout(self.engine, self.local, md)
            steps.prepare = time.perf_counter() - t1
        except BaseException as exc:  # cancelled too: the machine must not stay FETCHING
            self._failed(machine)
            if isinstance(exc, KvwireError):
                self._log_failure(addr, mode, steps, exc)
                if _trips_breaker(exc):
                    self.breaker.failed(addr.host, addr.port, life)
            raise
        self.breaker.succeeded(addr.host, addr.port)
        offset = base.clock_offset_s if upgrade and base is not None else fetched.clock_offset_s
        peer = _peer_rank(addr, mode, name, layout, fetched, offset)
        self._peers[addr] = peer
        self._loaded(addr, machine, mode)
        self._last_used[peer.engine_id] = time.monotonic()
        self._record(peer, mode, steps, upgrade)
        return peer

    def _machine(self, addr: PeerAddress) -> PeerHandshake:
        """The machine of ``addr``'s entry; a new one where there is none or the last life was removed."""
        machine = self._machines.get(addr)
        if machine is None or machine.is_terminal:
            machine = self._machines[addr] = PeerHandshake()
        return machine

    @staticmethod
    def _failed(machine: PeerHandshake) -> None:
        """A handshake failed (or was cancelled): a refresh's entry stays as it was."""
        if machine.state is HandshakeState.FETCHING:
            machine.handle(HandshakeEvent.FETCH_FAILED)
        elif machine.state is HandshakeState.UPGRADING:
            machine.handle(HandshakeEvent.UPGRADE_FAILED)

    def _loaded(self, addr: PeerAddress, machine: PeerHandshake, mode: PeerMode) -> None:
        full = mode is PeerMode.FULL
        state = machine.state
        if machine.is_terminal:
            # Forgotten while the fetch ran, and its answer loads the peer again: a new life of the entry.
            machine = self._machine(addr)
            machine.handle(HandshakeEvent.FETCH)
        elif state is HandshakeState.NOTIF_ONLY and full:
            machine.handle(HandshakeEvent.UPGRADE)  # a refresh of the same life, answered in full
        elif state in (HandshakeState.NOTIF_ONLY, HandshakeState.FULL):
            return  # a refresh of the same life in the mode it had: nothing changes
        # FETCHING or UPGRADING (anything else raises IllegalTransition here)
        machine.handle(HandshakeEvent.LOADED_FULL if full else HandshakeEvent.LOADED_NOTIF_ONLY)

    async def _fetch(
        self, addr: PeerAddress, mode: PeerMode, steps: _Steps, samples: int, deadline: float
    ) -> Fetched:
        """Attempts until success, a refusal, or the deadline; connection failures back off and retry."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            for attempt in range(self.retries + 1):
                steps.attempts = attempt + 1
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    return await fetch_metadata(
                        addr,
                        notif_only=mode is PeerMode.NOTIF_ONLY,
                        compat_hash=self._compat,
                        timeout_s=left,
                        secret=self._secret,
                        clock_samples=samples,
                        clock_rtt_target_s=self.clock_rtt_target_s,
                    )
                except PeerUnreachable:
                    pause = min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S) * random.uniform(0.5, 1.0)
                    if attempt == self.retries or loop.time() + pause >= deadline:
                        raise
                    self.stats.retries += 1
                    await asyncio.sleep(pause)
            raise HandshakeTimeout(f"{addr}: no answer within {self.timeout_s:.3g} s")
        finally:
            steps.fetch = time.perf_counter() - t0

    async def _add_agent(self, addr: PeerAddress, agent_name: str, metadata: bytes, deadline: float) -> str:
        left = deadline - asyncio.get_running_loop().time()
        try:
            name = await self.local.agent.load_peer(metadata, left)
        except AgentStalled as exc:
            raise HandshakeTimeout(f"{addr}: loading agent {agent_name}: {exc}") from exc
        except AgentBusy:
            raise  # the agent is held by another stuck call: a transport failure, not this peer's
        except TransportError as exc:
            raise HandshakeError(f"{addr}: loading agent {agent_name} failed: {exc}") from exc
        if name != agent_name:
            with contextlib.suppress(TransportError):
                self.local.agent.remove_peer(name)
            raise HandshakeError(f"{addr}: metadata loads agent {name!r}, reply names {agent_name!r}")
        return name

    def _drop(self, addr: PeerAddress, peer: PeerRank) -> None:
        if self._peers.get(addr) is peer:
            del self._peers[addr]
            machine = self._machines.get(addr)
            if machine is not None and not machine.is_terminal:
                machine.handle(HandshakeEvent.REMOVE)
        # Another address may name the same remote agent (e.g. "localhost" and "127.0.0.1").
        if not any(p.agent_name == peer.agent_name for p in self._peers.values()):
            with contextlib.suppress(TransportError):
                self.local.agent.remove_peer(peer.agent_name)

    # -- accounting ------------------------------------------------------------------------------------

    def _record(self, peer: PeerRank, mode: PeerMode, steps: _Steps, upgrade: bool) -> None:
        total = time.perf_counter() - steps.started
        self.stats.handshakes[mode] += 1
        self.stats.upgrades += int(upgrade)
        self.stats.durations_s[mode].append(total)
        log.info(
            "handshake %s -> %s:%d done: engine=%s/%s agent=%s rank=pp%d/tp%d of pp%d/tp%d mode=%s%s %s",
            self.local.agent.name,
            peer.host,
            peer.port,
            peer.engine_id,
            peer.incarnation,
            peer.agent_name,
            peer.pp_rank,
            peer.tp_rank,
            peer.pp_size,
            peer.tp_size,
            mode.value,
            " (upgrade)" if upgrade else "",
            steps.ms(),
        )

    def _log_failure(self, addr: PeerAddress, mode: PeerMode, steps: _Steps, exc: BaseException) -> None:
        reason = _reason(exc)
        self.stats.failures[reason] += 1
        log.warning(
            "handshake %s -> %s failed: reason=%s mode=%s %s: %s",
            self.local.agent.name,
            addr,
            reason.value,
            mode.value,
            steps.ms(),
            exc,
        )


def warm_up(agents: Sequence[Agent]) -> float:
    """Have each agent pay its transport's one-off first-load cost now (``Agent.warm_up``; NIXL's: UCX's
    first endpoint, 10-30 ms that would land in the first request's handshake); returns the seconds
    spent. Best effort: a failure is logged, never raised."""
    t0 = time.perf_counter()
    for agent in agents:
        try:
            agent.warm_up()
        except TransportError as exc:
            log.debug("agent warm-up failed: %s", exc)
    return time.perf_counter() - t0


def stalled_reason(managers: Iterable[HandshakeManager], now: float | None = None) -> str | None:
    """Why an engine with these handshake managers cannot move KV now, or None (an engine's ``/health``).

    An agent held by a NIXL call stuck past its handshake's deadline (a peer's UCX port unreachable)
    refuses every handshake and moves nothing until the call returns, minutes later. Any thread."""
    stuck = [(m.stalled_s(now), m.local.agent.name) for m in managers]
    stalled_s, agent = max(stuck, default=(0.0, ""))
    if stalled_s <= 0.0:
        return None
    return (
        f"agent {agent} held for {stalled_s:.1f} s by a NIXL call stuck on the network (a peer whose UCX "
        "port is unreachable): no KV moves and handshakes are refused until it returns"
    )


def max_mode(a: PeerMode, b: PeerMode) -> PeerMode:
    return PeerMode.FULL if PeerMode.FULL in (a, b) else PeerMode.NOTIF_ONLY


def _peer_rank(
    addr: PeerAddress,
    mode: PeerMode,
    agent_name: str,
    layout: RankLayout | None,
    fetched: Fetched,
    clock_offset_s: float,
) -> PeerRank:
    md = fetched.metadata
    return PeerRank(
        engine_id=md.engine_id,
        incarnation=md.incarnation,
        host=addr.host,
        port=addr.port,
        tp_size=md.tp_size,
        tp_rank=md.tp_rank,
        pp_size=md.pp_size,
        pp_rank=md.pp_rank,
        agent_name=agent_name,
        mode=mode,
        layout=layout,
        num_blocks=md.num_blocks,
        clock_offset_s=clock_offset_s,
    )
