"""HandshakeManager: the driver of one local rank's handshake core (``kvwire.core.handshake``).

The rules (the cache per peer address and rank, incarnation refresh and replacement, upgrade, the
deadline, retries and their backoff, the circuit breaker, the allow list, reaping, each address's
``PeerHandshake``) are the core's; this module does their I/O: the side-channel fetch
(``handshake/client.py``), the load of the peer's agent, the layout check, the tasks and the log lines.
It reads time only through the clock it is given (the connector's: one clock).

``ensure(host, port, pp, tp, mode)`` returns a ``PeerRank`` loaded into the local agent at least in
``mode``. Concurrent callers for one address share the one handshake in flight (``asyncio.shield``: a
caller that is cancelled does not cancel it for the others). A FULL handshake prepares no descriptor
list: the producer posts explicit coalesced descriptors built per request from the regions' base
addresses, so the cost is O(regions); it validates the geometry and builds a RankLayout.

Loading the peer's agent can wait on the network (UCX connects while NIXL loads): ``Agent.load_peer``
runs it off the loop within what is left of the deadline. A load past it fails the handshake with
``HandshakeTimeout`` and stays stuck in the agent's worker (undone if it ever succeeds); while it is
stuck, further loads on that agent are refused at once, and ``stalled_s`` says for how long, for
``/health``. One INFO line per completed handshake, one WARNING line per failed one (logger
``kvwire.handshake``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from kvwire.core.handshake import (
    HandshakeCore,
    max_mode,
)
from kvwire.core.handshake_io import (
    ENSURE_ROUNDS,
    Answered,
    Attempt,
    Close,
    Fail,
    Failed,
    Fetch,
    FetchErr,
    FetchOk,
    Forget,
    ForgetAgent,
    Forgot,
    HsAction,
    HsInput,
    HsStep,
    Join,
    Load,
    Loaded,
    LoadOk,
    Lookup,
    Ready,
    Reap,
    Reaped,
    Refuse,
    Sleep,
    Start,
    Touch,
    Unload,
    Want,
)
from kvwire.errors import AgentBusy, AgentStalled, HandshakeError, HandshakeTimeout, TransportError
from kvwire.handshake.breaker import CircuitBreaker
from kvwire.handshake.client import Fetched, fetch_metadata
from kvwire.handshake.layout import validate_layout
from kvwire.handshake.server import engine_compat_hash
from kvwire.handshake.types import EngineInfo, HandshakeManagerStats, LocalRank, PeerAddress, PeerRank
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.states import HandshakeState
from kvwire.transport.base import Agent, PeerMode

__all__ = ["HandshakeManager", "max_mode", "stalled_reason", "warm_up"]

log = logging.getLogger("kvwire.handshake")

Step = HsStep


@dataclass
class _Steps:
    """Seconds spent in each step of one handshake (for the log lines), in the driver's clock."""

    clock: Callable[[], float]
    started: float
    attempts: int = 0
    fetch: float = 0.0
    add_agent: float = 0.0
    prepare: float = 0.0

    def ms(self) -> str:
        total = self.clock() - self.started
        return (
            f"attempts={self.attempts} fetch={self.fetch * 1e3:.1f}ms load={self.add_agent * 1e3:.1f}ms "
            f"prepare={self.prepare * 1e3:.1f}ms total={total * 1e3:.1f}ms"
        )


class HandshakeManager:
    """Handshakes of one local rank (one local agent) with remote ranks: ``HandshakeCore``'s driver."""

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.local = local
        self.timeout_s = timeout_s
        # An offset is off by at most RTT/2: below this RTT one sample is enough (timers work in ms).
        self.clock_rtt_target_s = clock_rtt_target_s
        self._secret = secret or None
        self._compat = engine_compat_hash(engine)
        self._clock = clock
        # Addresses whose last handshakes failed on the network fail fast for a while (core/breaker.py);
        # the core hands it this manager's clock, whatever clock it was built with.
        self.breaker = breaker if breaker is not None else CircuitBreaker(clock=clock)
        self.core = HandshakeCore(
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            clock_samples=clock_samples,
            breaker=self.breaker,
            allowed=allowed,
        )
        self._inflight: dict[PeerAddress, asyncio.Task[PeerRank]] = {}

    @property
    def stats(self) -> HandshakeManagerStats:
        return self.core.stats

    @property
    def allowed(self) -> PeerAllowList:
        return self.core.allowed

    def _run(self, inp: HsInput, now: float | None = None) -> list[Step]:
        """Feed the core; run its ``Unload``s, return the rest (what the caller or the flight waits for)."""
        steps: list[Step] = []
        action: HsAction
        for action in self.core.handle(self._clock() if now is None else now, inp):
            match action:
                case Unload(agent_name):
                    with contextlib.suppress(TransportError):
                        self.local.agent.remove_peer(agent_name)
                case Ready() | Refuse() | Start() | Join() | Fetch() | Sleep() | Load() | Loaded() | Fail():
                    steps.append(action)
                case Reaped() | Forgot():
                    steps.append(action)
                case _:
                    assert_never(action)
        return steps

    @staticmethod
    def _answer(steps: list[Step]) -> PeerRank | None:
        """A caller's answer: the peer, None (the cache cannot answer), or the refusal raised."""
        for step in steps:
            if isinstance(step, Ready):
                return step.peer
            if isinstance(step, Refuse):
                raise step.error
        return None

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

        ``engine_id``, when given, must match the peer's (else ``PeerReplaced``: the engine there now is
        another, the named one restarted under a new id). ``incarnation``, when given, is the one the
        caller knows of (e.g. from a message): a cached entry of another incarnation or engine id is
        refreshed first. The peer's answer wins; compare ``PeerRank.incarnation`` to detect stale
        messages.
        """
        addr = PeerAddress(host, port, pp_rank, tp_rank)
        hit = self._answer(self._run(Lookup(addr, mode, engine_id, incarnation, dial=True)))
        if hit is not None:
            return hit
        joined = False
        for _ in range(ENSURE_ROUNDS):
            (step,) = self._run(Want(addr, mode, engine_id, incarnation, joined))
            if isinstance(step, Start):
                task = asyncio.create_task(self._flight(addr))
                self._inflight[addr] = task
                task.add_done_callback(functools.partial(self._done, addr))
            elif isinstance(step, Join):
                task = self._inflight[addr]
            else:
                answer = self._answer([step])
                assert answer is not None  # Ready or Refuse (raised)
                return answer
            peer = await asyncio.shield(task)
            joined = True
            answer = self._answer(self._run(Answered(mode, engine_id, peer)))
            if answer is not None:
                return answer
        raise HandshakeError(f"{addr}: not loaded in mode {mode.value} after {ENSURE_ROUNDS} rounds")

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
        have to handshake (a cached entry of another engine id or incarnation than named is a miss: the
        handshake asks the address again). No I/O, no await: callers on the loop skip a task per
        request."""
        addr = PeerAddress(host, port, pp_rank, tp_rank)
        return self._answer(self._run(Lookup(addr, mode, engine_id, incarnation)))

    def forget(self, engine_id: str, incarnation: str | None = None) -> None:
        """The peer is dead or gone: remove its remote agents and drop its entries. With ``incarnation``,
        only that life of it: a restarted peer already loaded under its new incarnation stays."""
        self._run(Forget(engine_id, incarnation))

    def forget_agent(self, agent_name: str) -> tuple[str, str] | None:
        """The process of remote agent ``agent_name`` is gone: forget its engine life here; which life
        that was (the other ranks' managers forget it too), or None if this rank did not know it."""
        for step in self._run(ForgetAgent(agent_name)):
            if isinstance(step, Forgot):
                return step.engine_id, step.incarnation
        return None

    def touch(self, engine_id: str, now: float | None = None) -> None:
        """Mark ``engine_id`` in use (at ``now``, in this manager's clock; default: its clock's now)."""
        self._run(Touch(engine_id), now)

    def reap_idle(
        self, now: float | None = None, ttl_s: float = 0.0, in_use: frozenset[str] = frozenset()
    ) -> list[str]:
        """Touch ``in_use``, then forget peers not used for ``ttl_s`` (vLLM's engine_ttl); their ids."""
        return [s.engine_id for s in self._run(Reap(in_use, ttl_s), now) if isinstance(s, Reaped)]

    def peers(self) -> list[PeerRank]:
        return list(self.core.peers.values())

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
        return self.core.peers.get(PeerAddress(host, port, pp_rank, tp_rank))

    def state(self, host: str, port: int, pp_rank: int, tp_rank: int) -> HandshakeState:
        """Where the entry of one remote rank stands in ``HANDSHAKE_TABLE`` (UNKNOWN if never fetched)."""
        return self.core.state(PeerAddress(host, port, pp_rank, tp_rank))

    async def close(self) -> None:
        """Cancel handshakes in flight and unload every remote agent; idempotent."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._run(Close())

    # -- one handshake ---------------------------------------------------------------------------------

    def _done(self, addr: PeerAddress, task: asyncio.Task[PeerRank]) -> None:
        if self._inflight.get(addr) is task:
            del self._inflight[addr]
        if not task.cancelled():
            task.exception()  # retrieved: callers re-raise it; unawaited failures must not warn

    async def _flight(self, addr: PeerAddress) -> PeerRank:
        """Run the core's steps for one handshake: fetch (and retry), load, check; its end."""
        steps = _Steps(self._clock, self._clock())
        fetched: Fetched | None = None
        ended = False
        try:
            (step,) = self._run(Attempt(addr))
            while True:
                if isinstance(step, Fetch):
                    fetched, nxt = await self._fetch(addr, step, steps)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    steps.fetch += step.seconds
                    nxt = self._run(Attempt(addr))
                elif isinstance(step, Load):
                    assert fetched is not None  # a Load follows a FetchOk
                    nxt = self._run(LoadOk(addr, await self._load(addr, step, fetched, steps)))
                elif isinstance(step, Loaded):
                    ended = True
                    self._log_done(step, steps)
                    return step.peer
                else:
                    assert isinstance(step, Fail), step
                    ended = True
                    self._log_failure(step, steps)
                    raise step.error
                (step,) = nxt
        except BaseException as exc:  # cancelled too: the core must not keep the flight
            if not ended:
                for end in self._run(Failed(addr, exc)):
                    if isinstance(end, Fail):
                        self._log_failure(end, steps)
            raise

    async def _fetch(
        self, addr: PeerAddress, step: Fetch, steps: _Steps
    ) -> tuple[Fetched | None, list[Step]]:
        """One attempt; the fetched metadata (None on failure) and what the core says next."""
        steps.attempts = step.attempt + 1
        t0 = self._clock()
        try:
            fetched = await fetch_metadata(
                addr,
                notif_only=step.notif_only,
                compat_hash=self._compat,
                timeout_s=step.timeout_s,
                secret=self._secret,
                clock_samples=step.samples,
                clock_rtt_target_s=self.clock_rtt_target_s,
            )
        except Exception as exc:
            # The backoff's jitter is the driver's randomness: the core stays deterministic.
            return None, self._run(FetchErr(addr, exc, random.uniform(0.5, 1.0)))
        finally:
            steps.fetch += self._clock() - t0
        md = fetched.metadata
        return fetched, self._run(FetchOk(addr, md.engine_id, md.incarnation))

    async def _load(self, addr: PeerAddress, step: Load, fetched: Fetched, steps: _Steps) -> PeerRank:
        md = fetched.metadata
        # The layout is checked before the agent is loaded: a peer refused here would otherwise stay loaded
        # (a remote agent and its UCX endpoint) for the agent's life, since it never enters the cache.
        t1 = self._clock()
        layout = None if step.mode is PeerMode.NOTIF_ONLY else validate_layout(self.engine, self.local, md)
        steps.prepare = self._clock() - t1
        t0 = self._clock()
        try:
            name = await self._add_agent(addr, md.agent_name, md.agent_metadata, step.timeout_s)
        finally:
            steps.add_agent = self._clock() - t0
        return _peer_rank(addr, step.mode, name, layout, fetched, fetched.clock_offset_s)

    async def _add_agent(self, addr: PeerAddress, agent_name: str, metadata: bytes, left: float) -> str:
        try:
            name = await self.local.agent.load_peer(metadata, left)
        except AgentStalled as exc:
            raise HandshakeTimeout(f"{addr}: loading agent {agent_name}: {exc}") from exc
        except AgentBusy:
            raise  # the agent is held by another stuck call: a transport failure, not this peer's
        except TransportError as exc:
            raise HandshakeError(f"{addr}: loading agent {agent_name} failed: {exc}") from exc
        if name != agent_name:
            # Unload it only if no cached peer is that agent: a reply may carry another peer's metadata
            # (a relay renaming it), and unloading that live peer cut it off for good.
            if not any(p.agent_name == name for p in self.core.peers.values()):
                with contextlib.suppress(TransportError):
                    self.local.agent.remove_peer(name)
            raise HandshakeError(f"{addr}: metadata loads agent {name!r}, reply names {agent_name!r}")
        return name

    # -- log lines -------------------------------------------------------------------------------------

    def _log_done(self, done: Loaded, steps: _Steps) -> None:
        peer = done.peer
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
            peer.mode.value,
            " (upgrade)" if done.upgrade else "",
            steps.ms(),
        )

    def _log_failure(self, fail: Fail, steps: _Steps) -> None:
        if fail.reason is None:
            return  # cancelled, or not a kvwire error (raised as is)
        log.warning(
            "handshake %s -> %s failed: reason=%s mode=%s %s: %s",
            self.local.agent.name,
            fail.addr,
            fail.reason.value,
            fail.mode.value,
            steps.ms(),
            fail.error,
        )


def warm_up(agents: Sequence[Agent], clock: Callable[[], float] = time.monotonic) -> float:
    """Have each agent pay its transport's one-off first-load cost now (``Agent.warm_up``; NIXL's: UCX's
    first endpoint, 10-30 ms that would land in the first request's handshake); returns the seconds
    spent. Best effort: a failure is logged, never raised."""
    t0 = clock()
    for agent in agents:
        try:
            agent.warm_up()
        except TransportError as exc:
            log.debug("agent warm-up failed: %s", exc)
    return clock() - t0


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
