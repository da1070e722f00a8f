"""The simulated engines' handshakes: the real handshake core (``kvwire.core.handshake``), one per local
rank as the connector has one ``HandshakeManager`` per rank, driven in virtual time. The simulator holds
no handshake rule of its own: the cache, refreshes, retries, the breaker and reaping are the core's; this
module only plays the side channel (latency, faults, partitions, lives) and the local agent's loads."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

from kvwire.core.handshake import (
    HandshakeCore,
    refusal,
)
from kvwire.core.handshake_io import (
    ENSURE_ROUNDS,
    Answered,
    Attempt,
    Fail,
    Fetch,
    FetchErr,
    FetchOk,
    Forget,
    ForgetAgent,
    Forgot,
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
from kvwire.core.io import HandshakeDone, StartHandshake
from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import HandshakeError, HandshakeTimeout, NobodyListens, NoSuchRank, PeerUnreachable
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.types import PeerMode
from kvwire.testing.sim.net import metered

if TYPE_CHECKING:
    from kvwire.testing.sim.engines import SimEngine
    from kvwire.testing.sim.net import World

_Flight = tuple[RankKey, PeerAddress]


class SimHandshakes:
    """One engine life's handshake cores and the flights they run."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        cfg = engine.config
        self.cores = {
            key: HandshakeCore(
                timeout_s=cfg.handshake_timeout_s, retries=cfg.handshake_retries, clock_samples=1
            )
            for key in engine.caches
        }
        if engine.world.meter_cores:
            for core in self.cores.values():
                setattr(core, "handle", metered(engine.world, core.handle))  # noqa: B010 (as in engines.py)
        self._waiters: dict[_Flight, list[tuple[StartHandshake, int]]] = {}
        self._fetched: dict[_Flight, tuple[SimEngine, int]] = {}

    def _run(self, key: RankKey, inp: HsInput) -> list[HsStep]:
        steps: list[HsStep] = []
        for action in self.cores[key].handle(self.engine.world.now, inp):
            match action:
                case Unload(agent_name):
                    self.engine.loaded[key].discard(agent_name)
                case Ready() | Refuse() | Start() | Join() | Fetch() | Sleep() | Load() | Loaded() | Fail():
                    steps.append(action)
                case Reaped() | Forgot():
                    steps.append(action)
                case _:
                    assert_never(action)
        return steps

    # -- what the protocol core's actions ask ------------------------------------------------------------
    def start(self, a: StartHandshake) -> None:
        addr = PeerAddress(a.host, a.port, a.remote[0], a.remote[1])
        steps = self._run(a.key, Lookup(addr, a.mode, a.engine_id, a.incarnation, dial=True))
        if steps:  # answered from the cache: at once, as the connector does (after this input, as an outcome)
            self._answer(a, steps[0], self.engine.follow, cached=True)
        else:
            self._want(a, addr, 0)

    def forget(self, engine_id: str, incarnation: str | None) -> None:
        for key in self.cores:
            self._run(key, Forget(engine_id, incarnation))

    def forget_agent(self, agent_name: str) -> None:
        """As the connector's ``_forget_agent``: a send found the agent's process gone."""
        for key in self.cores:
            for step in self._run(key, ForgetAgent(agent_name)):
                if isinstance(step, Forgot):
                    self.forget(step.engine_id, step.incarnation)
                    return

    def touch(self, engine_id: str) -> None:
        for key in self.cores:
            self._run(key, Touch(engine_id))

    def reap(self, in_use: frozenset[str]) -> int:
        """Unload the peers idle past ``engine_ttl_s``; how many engine ids were reaped."""
        ttl = self.engine.config.engine_ttl_s
        return sum(len(self._run(key, Reap(in_use, ttl))) for key in self.cores)

    # -- callers -----------------------------------------------------------------------------------------
    def _want(self, a: StartHandshake, addr: PeerAddress, rounds: int) -> None:
        if rounds == ENSURE_ROUNDS:
            self._done(HandshakeDone(a.token, None, f"{addr}: not loaded after {rounds} rounds"))
            return
        (step,) = self._run(a.key, Want(addr, a.mode, a.engine_id, a.incarnation, joined=rounds > 0))
        if isinstance(step, Start):
            self._waiters[(a.key, addr)] = [(a, rounds)]
            self._step(a.key, addr, Attempt(addr))
        elif isinstance(step, Join):
            self._waiters[(a.key, addr)].append((a, rounds))
        else:
            self._answer(a, step)

    def _answer(
        self,
        a: StartHandshake,
        step: HsStep,
        done: Callable[[HandshakeDone], None] | None = None,
        *,
        cached: bool = False,
    ) -> None:
        answer = done or self._done
        if isinstance(step, Ready):
            answer(HandshakeDone(a.token, step.peer, "", cached=cached))
        elif isinstance(step, Refuse):
            answer(self._failed(a, step.error))
        else:
            raise AssertionError(f"a caller got {step}")

    @staticmethod
    def _failed(a: StartHandshake, error: BaseException) -> HandshakeDone:
        return HandshakeDone(a.token, None, str(error), refusal(error), isinstance(error, NobodyListens))

    def _done(self, done: HandshakeDone) -> None:
        """Answer the protocol core when a flight ends, as its own event (the connector's task callback)."""
        engine, life = self.engine, self.engine.life

        def answer() -> None:
            if engine.life == life:
                engine.feed(done)

        engine.world.after(0.0, answer)

    # -- flights -----------------------------------------------------------------------------------------
    def _step(self, key: RankKey, addr: PeerAddress, inp: HsInput) -> None:
        (step,) = self._run(key, inp)
        if isinstance(step, Fetch):
            self._fetch(key, addr, step)
        elif isinstance(step, Sleep):
            life = self.engine.life
            self.engine.world.after(step.seconds, lambda: self._resume(life, key, addr))
        elif isinstance(step, Load):
            self._load(key, addr, step.mode)
        elif isinstance(step, Loaded):
            self._ended(key, addr, step.peer, None)
        elif isinstance(step, Fail):
            self._ended(key, addr, None, step.error)
        else:
            raise AssertionError(f"a flight got {step}")

    def _resume(self, life: int, key: RankKey, addr: PeerAddress) -> None:
        if life == self.engine.life:
            self._step(key, addr, Attempt(addr))

    def _fetch(self, key: RankKey, addr: PeerAddress, fetch: Fetch) -> None:
        """The side channel: answered after a little latency (and after a partition or freeze that ends
        within the attempt's deadline), or not before that deadline."""
        eng = self.engine
        w, f = eng.world, eng.world.faults
        target = w.addresses.get((addr.host, addr.port))
        delay = 200e-6 + w.rng.random() * 800e-6
        error: Exception | None = None
        back = None if target is None else _back_at(w, eng, target)
        if target is None or (back is not None and back >= w.now + fetch.timeout_s):
            error, delay = (
                HandshakeTimeout(f"{addr}: no answer within {fetch.timeout_s:.3g} s"),
                fetch.timeout_s,
            )
        else:
            if back is not None:
                # TCP retransmits the connect, and a frozen process's kernel queues it: the answer comes
                # once the link is back or the process thaws, within the attempt's deadline.
                delay += back - w.now
            if w.chance(f.failed_handshake, "failed_handshake"):
                error = HandshakeError(f"{addr}: side channel refused")
            elif (addr.pp_rank, addr.tp_rank) not in target.caches:
                error = NoSuchRank(f"{addr}: no such rank")
        life, tlife = eng.life, (target.life if target is not None else 0)
        w.after(delay, lambda: self._fetched_at(life, key, addr, target, tlife, error))

    def _fetched_at(
        self,
        life: int,
        key: RankKey,
        addr: PeerAddress,
        target: SimEngine | None,
        tlife: int,
        error: Exception | None,
    ) -> None:
        if life != self.engine.life:
            return  # this engine crashed meanwhile: its cores are gone
        if error is None and (target is None or target.life != tlife):
            error = PeerUnreachable(f"{addr}: connection reset (the peer restarted)")
        if error is not None or target is None:
            self._step(key, addr, FetchErr(addr, error or PeerUnreachable(str(addr))))
            return
        self._fetched[(key, addr)] = (target, tlife)
        self._step(key, addr, FetchOk(addr, target.wire_id, target.incarnation))

    def _load(self, key: RankKey, addr: PeerAddress, mode: PeerMode) -> None:
        target, _ = self._fetched.pop((key, addr))
        remote = (addr.pp_rank, addr.tp_rank)
        agent = target.agent_names[remote]
        self.engine.loaded[key].add(agent)
        peer = PeerRank(
            engine_id=target.wire_id,
            incarnation=target.incarnation,
            host=addr.host,
            port=addr.port,
            tp_size=target.tp,
            tp_rank=addr.tp_rank,
            pp_size=target.pp,
            pp_rank=addr.pp_rank,
            agent_name=agent,
            mode=mode,
            layout=target.layouts[remote] if mode is PeerMode.FULL else None,
            num_blocks=target.num_blocks,
            clock_offset_s=0.0,
        )
        self._step(key, addr, LoadOk(addr, peer))

    def _ended(
        self, key: RankKey, addr: PeerAddress, peer: PeerRank | None, error: BaseException | None
    ) -> None:
        for a, rounds in self._waiters.pop((key, addr), []):
            if peer is None:
                self._done(self._failed(a, error or HandshakeError(str(addr))))
                continue
            steps = self._run(key, Answered(a.mode, a.engine_id, peer))
            if steps:
                self._answer(a, steps[0])
            else:
                self._want(a, addr, rounds + 1)


def _back_at(w: World, eng: SimEngine, target: SimEngine) -> float | None:
    """When ``target`` can answer ``eng`` again (None: it can now): the end of their partition or of its
    freeze, whichever is later."""
    healed = w.partitions.get(frozenset((eng.engine_id, target.engine_id)), 0.0)
    back = max(healed, target.paused_until)
    return back if back > w.now else None
