"""Which prefill (P) and decode (D) engine serves a request: pure, no I/O.

The router keeps one ``EngineView`` per configured engine (refreshed from its ``/health``) and asks a
``Picker`` for one P and one D per request. Round robin rotates over the healthy engines of a role; least
loaded takes the engine with the fewest running + waiting requests (as last reported, plus the requests this
router has sent it since), breaking ties by the most free blocks, then by rotation so that equal engines
share the work.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.config import Policy
from kvwire.errors import KvwireError


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoHealthyEngine(KvwireError):
    """Every configured engine of a role is down (or none is configured)."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} engine")
        self.role = role


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0


@dataclass(frozen=True)
class EngineView:
    """What the policy may look at: an engine's URL, health, last reported load and our in-flight count."""

    url: str
    healthy: bool
    load: Load = Load()
    inflight: int = 0


class Picker:
    """Picks one engine per call. Keeps only a rotation counter (per role) as state."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._turn: dict[Role, int] = {Role.PREFILL: 0, Role.DECODE: 0}

    def pick(self, role: Role, engines: Sequence[EngineView]) -> EngineView:
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            raise NoHealthyEngine(role)
        turn = self._turn[role]
        self._turn[role] = turn + 1
        if self.policy is Policy.ROUND_ROBIN:
            return healthy[turn % len(healthy)]
        return least_loaded(healthy, turn)


def busy(engine: EngineView) -> int:
    """Requests an engine is working on: its last report, or what we sent it since, whichever is more."""
    return max(engine.load.running + engine.load.waiting, engine.inflight)


def least_loaded(engines: Sequence[EngineView], turn: int = 0) -> EngineView:
    """The least busy engine; ties go to the most free blocks, then to rotation by ``turn``."""
    if not engines:
        raise ValueError("least_loaded needs at least one engine")
    n = len(engines)
    order = [engines[(turn + i) % n] for i in range(n)]
    # min() keeps the first of equal keys, so rotating the list first spreads ties.
    return min(order, key=lambda e: (busy(e), -e.load.free_blocks))
