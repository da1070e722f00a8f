"""Drive one sans-IO core by hand, in explicit time: a tiny driver for deterministic core tests.

``CoreHarness.at(now, input)`` hands the input to the core and executes the actions as a driver must
(``kvwire.core.io``): a tokened ``Send``/``PostWrite``/``PostRead`` gets its ``Outcome`` fed back before
anything else (ok unless ``accept`` says no). Everything the core did in that step comes back as one flat
list, in order, and is also appended to ``log``. Nothing else is simulated: handshake answers and
transfer ends are the test's to feed (``done``, ``ended``), at the times the test chooses.

``TestEngine`` builds one engine's identity and per-rank layouts from real (small) ``KVCache`` memory, as
the simulator's engines do, and answers what a peer would see of it (``peer_rank``, ``notif``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvwire.core.base import TIMER_PERIOD_S, CoreBase, Feeder
from kvwire.core.io import (
    Action,
    Digest,
    Digested,
    Emit,
    HandshakeDone,
    Input,
    NotifIn,
    Outcome,
    PostRead,
    PostWrite,
    Reap,
    Send,
    Tick,
    TouchPeer,
    XferEnded,
)
from kvwire.handshake.types import EngineInfo, PeerRank
from kvwire.kv.cache import KVCache
from kvwire.kv.mapping import RankLayout, layer_window
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import FailReason, Heartbeat, Notification, TransferMode
from kvwire.protocol.ranks import RankKey
from kvwire.transport.base import PeerMode, make_agent_name

SMALL_SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=4, dtype="float8", block_size=4)

A = TypeVar("A")


@dataclass
class TestEngine:
    """One engine's identity, caches and layouts (every (pp, tp) rank), reachable at ``host:port``."""

    __test__ = False  # not a pytest class

    info: EngineInfo
    caches: dict[RankKey, KVCache]
    layouts: dict[RankKey, RankLayout]
    num_blocks: int
    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def build(
        cls,
        engine_id: str,
        *,
        tp: int = 1,
        pp: int = 1,
        mode: TransferMode = TransferMode.PUSH,
        num_blocks: int = 16,
        spec: KVSpec = SMALL_SPEC,
        incarnation: str | None = None,
        port: int = 0,
    ) -> TestEngine:
        inc = incarnation or f"{engine_id}-life1"
        caches: dict[RankKey, KVCache] = {}
        for p in range(pp):
            window = layer_window(spec.num_layers, pp, p)
            for t in range(tp):
                caches[(p, t)] = KVCache(
                    spec, num_blocks, tp_size=tp, tp_rank=t, first_layer=window.start, num_layers=len(window)
                )
        layouts = {k: RankLayout.from_cache(c, pp_size=pp, pp_rank=k[0]) for k, c in caches.items()}
        info = EngineInfo(engine_id, inc, "test", spec, tp, pp, mode)
        return cls(info, caches, layouts, num_blocks, port=port)

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    @property
    def incarnation(self) -> str:
        return self.info.incarnation

    def agent(self, key: RankKey = (0, 0)) -> str:
        """The NIXL agent name of rank ``key`` (what a peer sees as the sender)."""
        return make_agent_name(self.info.engine_id, self.info.incarnation, *key)

    def peer_rank(self, key: RankKey = (0, 0), mode: PeerMode = PeerMode.FULL) -> PeerRank:
        """What a peer's successful handshake with rank ``key`` returns."""
        return PeerRank(
            engine_id=self.info.engine_id,
            incarnation=self.info.incarnation,
            host=self.host,
            port=self.port,
            tp_size=self.info.tp_size,
            tp_rank=key[1],
            pp_size=self.info.pp_size,
            pp_rank=key[0],
            agent_name=self.agent(key),
            mode=mode,
            layout=self.layouts[key] if mode is PeerMode.FULL else None,
            num_blocks=self.num_blocks,
            clock_offset_s=0.0,
        )

    def notif(self, msg: Notification, *, to: RankKey = (0, 0), rank: RankKey = (0, 0)) -> NotifIn:
        """``msg`` as delivered to the peer's local rank ``to``, sent by this engine's rank ``rank``."""
        return NotifIn(to, self.agent(rank), encode_notif(msg))


@dataclass
class CoreHarness:
    """A driver for one core, by hand: see the module's docstring."""

    __test__ = False

    core: CoreBase
    # Whether the transport accepts a tokened Send/PostWrite/PostRead (its Outcome's ``ok``).
    accept: Callable[[Action], bool] = lambda action: True
    # The answer to a ``Digest`` (kv.digest.kv_digest over a cache; None: memory that cannot be read).
    digest: Callable[[Digest], bytes | None] = lambda action: None
    now: float = 0.0
    log: list[Action] = field(default_factory=list)

    def at(self, now: float, inp: Input) -> list[Action]:
        """Feed ``inp`` at ``now`` (never earlier than the last step) and the Outcomes its actions call for;
        every action of the step, in order. A ``Refused`` from the core propagates (nothing recorded)."""
        if now < self.now:
            raise ValueError(f"time goes backwards: {now} < {self.now}")
        self.now = now
        out: list[Action] = []

        def execute(action: Action) -> None:
            out.append(action)
            if isinstance(action, Send | PostWrite | PostRead) and action.token:
                feeder.follow(Outcome(action.token, self.accept(action)))
            elif isinstance(action, Digest):
                feeder.follow(Digested(action.token, self.digest(action)))

        def failed(item: Input, exc: Exception) -> None:
            raise exc

        feeder = Feeder(self.core, execute, failed)
        feeder.feed(now, inp)
        self.log.extend(out)
        return out

    def tick(self, now: float) -> list[Action]:
        return self.at(now, Tick())

    def ticks(self, until: float, step: float) -> list[Action]:
        """Tick every ``step`` seconds after ``now`` up to ``until`` (the last tick exactly at ``until``).
        ``step`` must exceed ``TIMER_PERIOD_S``, or some ticks would not run the timers."""
        if step <= TIMER_PERIOD_S:
            raise ValueError(f"step {step} s: timers run at most every {TIMER_PERIOD_S} s")
        out: list[Action] = []
        t = self.now
        while t + step < until:
            t += step
            out += self.tick(t)
        out += self.tick(until)
        return out

    def done(
        self,
        now: float,
        token: int,
        peer: PeerRank | None,
        error: str = "",
        reason: FailReason = FailReason.HANDSHAKE_FAILED,
        *,
        nobody_listens: bool = False,
        cached: bool = False,
    ) -> list[Action]:
        """Answer a ``StartHandshake``."""
        return self.at(now, HandshakeDone(token, peer, error, reason, nobody_listens, cached))

    def ended(self, now: float, token: int, ok: bool = True, detail: str = "") -> list[Action]:
        """A posted transfer ended."""
        return self.at(now, XferEnded(token, ok, detail))


# -- reading actions ----------------------------------------------------------------------------------------


def only(actions: Sequence[Action], kind: type[A]) -> list[A]:
    """The actions of one type, in order."""
    return [a for a in actions if isinstance(a, kind)]


def one(actions: Sequence[Action], kind: type[A]) -> A:
    """The one action of ``kind`` (fails when there are none or several)."""
    found = only(actions, kind)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind.__name__}, got {len(found)}: {list(actions)}")
    return found[0]


def sent(actions: Sequence[Action], kind: type[A] | None = None) -> list[A]:
    """The messages sent (of type ``kind`` when given), in order."""
    msgs = [a.msg for a in actions if isinstance(a, Send)]
    return [m for m in msgs if kind is None or isinstance(m, kind)]  # type: ignore[misc]


def events(actions: Sequence[Action]) -> list[object]:
    """The events emitted to the engine, in order."""
    return [a.event for a in actions if isinstance(a, Emit)]


def protocol(actions: Sequence[Action]) -> list[Action]:
    """The actions without the periodic chatter (heartbeats, reaps, touches): what a rule did."""
    return [
        a
        for a in actions
        if not isinstance(a, Reap | TouchPeer) and not (isinstance(a, Send) and isinstance(a.msg, Heartbeat))
    ]
